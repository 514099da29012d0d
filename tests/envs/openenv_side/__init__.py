"""Scripts the interoperability tests run in openenv-core's own venv (``make openenv``): they import
openenv only, never ragen-flow."""
