"""``deepdpm predict``: a folder of Parquet files over Ray Data (:mod:`pipeline.predict.folder`),
a file in the command's process, its model's header and assigner read without torch
(docs/design.md, "Package map" and "Prediction and serving").
"""
