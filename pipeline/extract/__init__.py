"""The extraction side: image folders -> webdataset shards -> image embeddings in Parquet.

- :mod:`pipeline.extract.shards`: image folders written as ``.tar`` shards (``deepdpm shards``);
- :mod:`pipeline.extract.preprocess`: a sample's image decoded, resized and cropped;
- :mod:`pipeline.extract.encoders`, :mod:`pipeline.extract.encoder_choices`: the encoders
  and their torch-free CLI choices;
- :mod:`pipeline.extract.shard_inputs`: the shards a run reads and their sample counts;
- :mod:`pipeline.extract.manifest`: the per-shard outputs, the manifest and the report;
- :mod:`pipeline.extract.ray_pipeline`: the Ray Data pipeline (``deepdpm extract``).

Submodules are imported on use: the CLI reads the choices without importing torch.
"""
