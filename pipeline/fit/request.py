"""One typed request for every fit: local, Ray, or alternating with an autoencoder.

A :class:`FitRequest` holds what ``deepdpm fit`` parsed from its flags (or what a test
builds): input, output, config, how the fit runs and how it is tracked. It is frozen and
JSON-serialisable: a fit with checkpoints stores it as ``OUT/fit_request.json`` so that
``--resume OUT`` continues the run as it was started, and a Ray fit ships it to its workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from deepdpm_core.config import Config, from_dict, load_config, parse_overrides
from deepdpm_core.errors import CheckpointError, ConfigError
from pipeline.io.columns import TableColumns
from pipeline.tracking.options import DEFAULT_EXPERIMENT, DEFAULT_MODEL_ALIAS

REQUEST_FILE = "fit_request.json"
#: how a fit runs: in this process, on Ray Train workers, or alternating with an AE
FitMode = Literal["local", "ray", "alternating"]
MODES = ("local", "ray", "alternating")


def config_from_args(config_path: str | None, overrides: list[str] | None, seed: int | None) -> Config:
    """``--config`` YAML (or defaults) + ``--set key=value`` overrides + ``--seed``.

    Parameters
    ----------
    config_path : str, optional
        A YAML config; None: the built-in defaults.
    overrides : list of str, optional
        ``key=value`` strings.
    seed : int, optional
        Replaces the config's seed.

    Returns
    -------
    Config
    """
    cfg = load_config(config_path) if config_path else from_dict(None)
    over = parse_overrides(overrides or [])
    if seed is not None:
        over["seed"] = seed
    return cfg.with_overrides(over) if over else cfg


@dataclass(frozen=True)
class FitRequest:
    """Everything a fit needs, in every mode.

    Paths are absolute where the CLI builds them: Ray workers may run in other
    directories or on other nodes. Every request names its mode.

    Parameters
    ----------
    input, output : str
        Feature input (a file or folder :func:`pipeline.io.tables.read_features` reads)
        and output folder.
    columns : dict
        Which columns of a wide table are the features, label and key
        (:class:`pipeline.io.columns.TableColumns` as a dict; empty: the defaults).
    config : Config
        The full config, validated once (a mapping is validated into one: :func:`from_dict`).
    mode : {"local", "ray", "alternating"}
    num_workers : int
        Ray Train workers (1, the default, for the in-process modes).
    use_gpu : bool
        One GPU per worker; in process: ``device=cuda``.
    checkpoint_every : int
        Epochs between checkpoints (0: only Ray's final one).
    resumable : bool
        Store this request and keep checkpoints, so ``--resume`` can continue the fit.
        A local fit without ``--checkpoint-every`` is not resumable.
    max_failures : int
        Ray worker failures recovered from the last checkpoint (-1: no limit).
    tracking, tracking_uri, experiment, run_name, register_model, model_alias
        MLflow tracking (:class:`pipeline.tracking.run_tracker.RunTracker`).
    quiet : bool
        No progress bars.
    alternations : int
        Alternating mode: AE <-> DeepDPM rounds after the first clustering.
    resume : bool
        Continue from the latest checkpoint in ``output``.
    overwrite : bool
        Start afresh in an output folder that holds an earlier fit.
    ray_address : str, optional
        The Ray cluster (default ``$RAY_ADDRESS``, else a new local one).
    wait_for_workers_s : float
        How long an existing Ray cluster may take to offer the workers' resources.
    fit_id : str, optional
        This fit's identity (:meth:`stamped`), also in its checkpoints and ``summary.json``.
    input_fingerprint : dict, optional
        The input's size and content hash when the request was stored
        (:func:`pipeline.io.input_fingerprint.input_fingerprint`).
    replaces : str, optional
        SHA-256 of the ``summary.json`` of the finished fit this one overwrites (None:
        the folder held none), which stays until this fit publishes.
    """

    input: str
    output: str
    config: Config
    mode: FitMode
    num_workers: int = 1
    use_gpu: bool = False
    checkpoint_every: int = 5
    resumable: bool = True
    max_failures: int = 3
    tracking: bool = True
    tracking_uri: str | None = None
    experiment: str = DEFAULT_EXPERIMENT
    run_name: str | None = None
    register_model: str | None = None
    model_alias: str = DEFAULT_MODEL_ALIAS
    quiet: bool = False
    alternations: int = 0
    resume: bool = False
    overwrite: bool = False
    ray_address: str | None = None
    wait_for_workers_s: float = 120.0
    fit_id: str | None = None
    input_fingerprint: dict[str, Any] | None = None
    replaces: str | None = None
    columns: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.config, Config):
            object.__setattr__(self, "config", from_dict(self.config))
        object.__setattr__(self, "columns", TableColumns.of(self.columns).to_dict())
        if self.mode not in MODES:
            raise ConfigError(f"fit mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.num_workers < 1:  # Ray Train's 0 (local mode) would drop the checkpoints
            raise ConfigError(f"a Ray fit needs --num-workers >= 1, got {self.num_workers} (without "
                              "--ray-address, 0 or 1 fit in this process)")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.max_failures < -1:
            raise ConfigError(f"--max-failures must be >= -1 (-1: no limit), got {self.max_failures}")
        if self.alternations < 0:
            raise ConfigError(f"--alternate must be >= 0, got {self.alternations}")

    @property
    def table_columns(self) -> TableColumns:
        """:attr:`columns` as the readers take them."""
        return TableColumns.of(self.columns)

    @property
    def in_process(self) -> bool:
        """True for the modes that fit in the calling process (local, alternating)."""
        return self.mode != "ray"

    def fit_config(self) -> Config:
        """The config the fit runs with (``use_gpu`` in process: ``device=cuda``; a Ray
        worker sets the device it was given itself)."""
        if self.use_gpu and self.in_process:
            return self.config.model_copy(update={"device": "cuda"})
        return self.config

    def tracker(self, rank: int = 0, hold_s: float = 0.0):
        """A :class:`pipeline.tracking.run_tracker.RunTracker` for this fit (inactive off rank
        0), its calls held ``hold_s`` seconds."""
        from pipeline.tracking.run_tracker import RunTracker

        return RunTracker(self.tracking_uri, self.experiment, enabled=self.tracking,
                          run_name=self.run_name, rank=rank, register_model=self.register_model,
                          model_alias=self.model_alias, output=self.output, hold_s=hold_s)

    def stamped(self) -> FitRequest:
        """This request as a new fit: a fresh :attr:`fit_id`, and in :attr:`replaces` the
        finished fit that ``output`` holds now (a resume keeps its request as stored)."""
        if self.resume:
            return self
        return self.with_(fit_id=uuid.uuid4().hex, input_fingerprint=None,
                          replaces=summary_digest(self.output))

    def save(self) -> None:
        """Write the request to ``output/fit_request.json`` (atomically), with the
        fingerprint of its input."""
        from deepdpm_core.atomic_files import write_json_atomic
        from pipeline.io.input_fingerprint import input_fingerprint

        # how this invocation started is not part of the run: a resume starts afresh
        stored = self.with_(resume=False, overwrite=False)
        if stored.input_fingerprint is None:
            stored = stored.with_(input_fingerprint=input_fingerprint(self.input))
        write_json_atomic({**dataclasses.asdict(stored), "config": stored.config.to_dict()},
                          Path(self.output) / REQUEST_FILE)

    @classmethod
    def load(cls, run_dir: str | Path) -> FitRequest:
        """The request of the run in ``run_dir`` (``--resume``).

        Raises
        ------
        CheckpointError
            ``run_dir`` holds no request, or an unreadable one.
        """
        path = Path(run_dir) / REQUEST_FILE
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointError(
                f"{run_dir} is not the output directory of a fit with checkpoints (no {REQUEST_FILE})"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path} is not a valid fit request: {exc}") from exc

    def check_resumable(self) -> None:
        """Refuse to resume unless ``output``'s request, its input and its finished fit (if
        any) belong together; the checkpoints are checked against :attr:`fit_id` where
        they are read (:func:`pipeline.fit.checkpoints.check_fit_id`).

        Raises
        ------
        CheckpointError
            One line: a request of an older version (no fit id), an input that changed
            since the fit started, or a finished fit in ``output`` other than this one and
            other than the one it replaces.
        """
        from pipeline.io.input_fingerprint import fingerprint_change, input_fingerprint

        out = Path(self.output)
        if self.fit_id is None or self.input_fingerprint is None:
            raise CheckpointError(
                f"{out / REQUEST_FILE} does not record its fit's identity and input fingerprint "
                "(written by an older deepdpm): its checkpoints cannot be checked against its "
                f"input; start afresh with deepdpm fit --input ... --output {out} --overwrite")
        try:
            now = input_fingerprint(self.input)
        except OSError as exc:
            raise CheckpointError(f"cannot resume the fit in {out}: its input {self.input} cannot "
                                  f"be read ({exc.strerror or exc})") from None
        change = fingerprint_change(self.input_fingerprint, now)
        if change is not None:
            raise CheckpointError(
                f"cannot resume the fit in {out}: its input {self.input} changed since it started "
                f"({change}); start afresh with --overwrite")
        digest = summary_digest(out)
        if digest is None or digest == self.replaces:
            return
        try:
            finished = json.loads((out / "summary.json").read_text()).get("fit_id")
        except (OSError, ValueError, AttributeError):
            finished = None
        if finished != self.fit_id:
            raise CheckpointError(
                f"cannot resume into {out}: it holds a finished fit (summary.json) that is not the "
                f"one its {REQUEST_FILE} and checkpoints belong to, and resuming would replace it; "
                "start afresh with --overwrite, or choose another --output")

    def with_(self, **changes: Any) -> FitRequest:
        """A copy with ``changes`` applied (checked again)."""
        return dataclasses.replace(self, **changes)


def summary_digest(out: str | Path) -> str | None:
    """SHA-256 of ``out/summary.json`` (the finished fit the folder holds); None without one."""
    try:
        return hashlib.sha256((Path(out) / "summary.json").read_bytes()).hexdigest()
    except (FileNotFoundError, NotADirectoryError):
        return None


__all__ = ["MODES", "REQUEST_FILE", "FitMode", "FitRequest", "config_from_args", "summary_digest"]
