"""What a stage is given, checked before any work: model inputs (model_inputs.py: a committed model artifact or a
plain Hugging Face folder on any fsspec URI, fingerprinted by content and fetched once per machine into the
cache; hub.py: models and datasets on the Hugging Face hub, resolved to a commit and fetched once per node), the tokenizer conventions of real checkpoints (models.py: pad / EOS lists / BOS / chat templates, adapter
merges) and datasets in OpenRLHF's keys and formats (data.py: row schemas, loaders, mixtures, `DataError` naming
file, row and key). Sits on the store; nothing above it."""
