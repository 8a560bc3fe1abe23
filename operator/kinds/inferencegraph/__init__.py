"""The inferencegraph kind: see kinds/__init__.py for the modules' roles."""
