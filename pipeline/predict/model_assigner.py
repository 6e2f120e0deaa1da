"""``python -m pipeline.predict.model_assigner MODEL OUT``: the part of a model that assigns rows.

Run by the folder predict's driver in a child process (:func:`pipeline.predict.files.read_assigner`):
it reads the :class:`~deepdpm_core.model.fitted_model.ClusterAssigner` of the model file MODEL
(the clustering net and the input transform; the mixture parameters are never read),
writes its state to OUT as a torch file and prints ``{"dim": D, "n_clusters": K}`` on
stdout. A model file it cannot use is one line on stderr and exit status 2.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

#: the exit status of a model file that cannot be used (the message is on stderr)
BAD_MODEL = 2


def assigner_state(model_file: str | Path) -> tuple[int, int, bytes]:
    """D, K and the assigner of a model file as the bytes of a torch file of its state.

    Raises
    ------
    CheckpointError
        Not a PyTorch checkpoint, not safe to read, or not a DeepDPM model.
    """
    import torch

    from deepdpm_core.model import ClusterAssigner

    model = ClusterAssigner.load(model_file)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return model.dim, model.n_clusters, buffer.getvalue()


def main(argv: list[str] | None = None) -> int:
    from deepdpm_core.errors import DeepDPMError

    model_file, out = sys.argv[1:] if argv is None else argv
    try:
        dim, n_clusters, state = assigner_state(model_file)
    except DeepDPMError as exc:
        print(exc, file=sys.stderr)
        return BAD_MODEL
    Path(out).write_bytes(state)
    print(json.dumps({"dim": dim, "n_clusters": n_clusters}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
