"""``python -m pipeline.model_assigner MODEL OUT``: the part of a model that assigns rows.

Run by the folder predict's driver in a child process (:func:`pipeline.ray_predict.read_assigner`):
it reads the :class:`~deepdpm_core.fitted_model.ClusterAssigner` of the model file MODEL
(the clustering net and the input transform; the mixture parameters are never read),
writes its state to OUT with ``torch.save`` and prints ``{"dim": D, "n_clusters": K}``
on stdout. A model file it cannot use is one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import sys

#: the exit status of a model file that cannot be used (the message is on stderr)
BAD_MODEL = 2


def main(argv: list[str] | None = None) -> int:
    import torch

    from deepdpm_core.errors import DeepDPMError
    from deepdpm_core.fitted_model import ClusterAssigner

    model_file, out = sys.argv[1:] if argv is None else argv
    try:
        model = ClusterAssigner.load(model_file)
    except DeepDPMError as exc:
        print(exc, file=sys.stderr)
        return BAD_MODEL
    torch.save(model.state_dict(), out)
    print(json.dumps({"dim": model.dim, "n_clusters": model.n_clusters}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
