"""The extraction side: image folders -> webdataset shards -> image embeddings in Parquet.

- :mod:`pipeline.extract.shards`: image folders written as ``.tar`` shards (``deepdpm shards``);
- :mod:`pipeline.extract.preprocess`: a sample's image decoded, resized and cropped;
- :mod:`pipeline.extract.encoders`, :mod:`pipeline.extract.encoder_choices`: the image
  encoders and their torch-free CLI choices;
- :mod:`pipeline.extract.shard_inputs`: which shards a run reads and how many samples each holds;
- :mod:`pipeline.extract.manifest`: the per-shard outputs, their metadata, the manifest
  and the run's report;
- :mod:`pipeline.extract.ray_pipeline`: the Ray Data pipeline and
  :func:`~pipeline.extract.ray_pipeline.extract_features` (``deepdpm extract``).

Submodules are imported on use: the CLI reads the choices without importing torch.
"""
