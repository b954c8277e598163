"""Generated from protos/retrieval/v1 by protos/generate.sh; do not edit."""
