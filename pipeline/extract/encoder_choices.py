"""Names the extraction options accept, in a torch-free module.

Shared by :mod:`pipeline.extract.encoders`, :mod:`pipeline.extract.ray_pipeline` and the ``extract``
command, whose parser (``deepdpm --help``) must not import torch.
"""

ENCODERS = ("moco_v2", "moco_v3", "torchvision", "pixels")
RESNET_ARCHS = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "wide_resnet50_2",
    "wide_resnet101_2",
)
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
