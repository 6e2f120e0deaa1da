"""``deepdpm predict`` over a folder of Parquet files, one output file per input file.

- :mod:`pipeline.predict.folder`: the Ray Data pipeline (model actors, the driver that
  collects each file's row groups) and :func:`~pipeline.predict.folder.predict_folder`;
- :mod:`pipeline.predict.files`: the per-file side: the inputs and their checks, the
  model's digest and assigner, an output's completeness and its atomic writing.

A file is predicted in the command's process; two modules read a model file there without
torch: :mod:`pipeline.predict.model_header` (D and the feature names, checked before
anything loads) and :mod:`pipeline.predict.numpy_assigner` (the input transform and the
clustering net, run in NumPy).
"""
