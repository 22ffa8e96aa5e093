"""Model families, one folder each: ``<family>/spec.py`` (its ``ModelSpec``), ``stage.py`` (the adapter: the
``Stage`` the engine calls), ``pipeline.py`` (the diffusers-compatible pipeline class), ``presets.py`` (built-in
random-weight models). What several families share lives in ``common/``; ``registry.py`` collects the specs."""
