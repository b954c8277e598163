"""Search engines behind one interface (`base.Engine`): `embedded/` and `opensearch/`.

Nothing outside this package knows an engine's query language.
"""
