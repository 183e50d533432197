"""The reference models and data the ``lightning-zero train`` CLI builds: a byte-level GPT, a small MLP,
and their datasets / LightningDataModules (``model=`` and ``data=`` options).

They live here, below ``config/`` and the estimator, so that those tools never import the
``experiments`` package (the top layer, which re-exports them under their old names).
"""
