"""Offline tooling: nothing here is imported by the serving process.

- ``builder/``: turns weights shipped in registry packages (and the committed reranker delta
  in ``builder/artifacts/``) into servable model dirs (``make models``);
- ``training/``: the reranker trainer (pack, lower-layer cache, split trainer, ship).

Serving (``service/models/``) only loads the model dirs these write.
"""
