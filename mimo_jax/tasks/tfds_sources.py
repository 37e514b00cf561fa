"""TFDS builders over local prompt files (and the resumable index stream they are read through).

Every source is written once into a caller-given ``data_dir`` as ``array_record`` files
(the only TFDS format that works without TensorFlow) and read back with random access
through :meth:`tfds.core.DatasetBuilder.as_data_source`.  Nothing is downloaded.

Sources (the ``kind`` of :func:`load_prompt_source`):

* ``"gsm8k"`` (:class:`Gsm8kBuilder`): ``question`` and ``answer`` strings; a row whose
  answer has no ``#### <number>`` final answer is malformed (as in
  :func:`mimo_jax.tasks.gsm8k.load_gsm8k_jsonl`).  Defaults to the shipped samples.
* ``"humaneval"`` (:class:`HumanEvalBuilder`): ``task_id``, ``prompt``,
  ``canonical_solution``, ``test`` and ``entry_point`` strings, from ``.jsonl`` or
  ``.jsonl.gz``.
* ``"jsonl"`` (:class:`JsonlPromptsBuilder`): any JSON-lines file; a *field map*
  ``{feature: json_key}`` (e.g. ``{"prompt": "question", "answer": "solution"}``) names
  the string fields to keep and what to call them.  The field map is part of the
  builder's :class:`JsonlSourceConfig`, so one builder class serves every mapping and each
  mapping gets its own cache directory.
* ``"arith"`` (:class:`ArithBuilder`): the synthetic :class:`~mimo_jax.tasks.arith.ArithTask`
  described by an :class:`ArithSpec`: a ``train`` split of ``num_rows`` distinct
  generated problems (never a held-out one) and a ``test`` split of the task's held-out
  problems.

Every JSONL row also records ``source_line``, its 1-based line number in the file.
Rows keep their file order (``disable_shuffling=True``); text is stored verbatim.

Caching: the builder config's name is a hash of the source files' *contents* (SHA-256 of
the bytes as stored, so of the compressed bytes for ``.gz``), the field map and a format
version.  The dataset therefore lives in ``data_dir/<builder>/<hash>/<version>/``; an
unchanged file reuses it, a changed file hashes differently and is built afresh in a new
directory (old directories are left for the caller to delete).  The file is hashed again
while building, and a file that changed in between is an error rather than a mislabelled
cache.

Malformed rows (not UTF-8, not JSON, nested too deeply to parse, a string with a lone
UTF-16 surrogate, not an object, a field missing, not a string or blank, or a
kind-specific check failing; see :data:`mimo_jax.tasks.splits.MALFORMED_KINDS`) are never
silently dropped and never abort the build: they are counted per kind, the first one is
logged as a warning (line number, reason and text), and per split the count, the count of
each kind and the first offender are stored in the dataset's ``metadata.json``
(``builder.info.metadata["splits"][split]``) and exposed as
:attr:`PromptSource.num_malformed` and :attr:`PromptSource.malformed_by_kind`.  Blank
lines are not rows; a UTF-8 byte-order mark at the start of a file is accepted.  A split without any
usable row raises :class:`ValueError` naming the file.

:class:`PromptStream` (:mod:`mimo_jax.data.prompt_stream`, re-exported here) turns a dataset size
into a reproducible stream of indices: one permutation per epoch, derived from ``(seed, epoch)``
alone, with a JSON-able ``state_dict`` from which a restored stream continues identically.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import logging
import math
import operator
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from mimo_jax.data.prompt_stream import PromptStream
from mimo_jax.tasks.arith import ArithTask
from mimo_jax.tasks.gsm8k import DEFAULT_TEST_PATH as GSM8K_TEST_PATH
from mimo_jax.tasks.gsm8k import DEFAULT_TRAIN_PATH as GSM8K_TRAIN_PATH
from mimo_jax.tasks.gsm8k import gold_answer
from mimo_jax.tasks.splits import Malformed, check_string_fields, describe_kinds, parse_json_object

__all__ = [
  "DEFAULT_FIELD_MAP",
  "GSM8K_FIELDS",
  "HUMANEVAL_FIELDS",
  "KINDS",
  "LINE_FEATURE",
  "ArithBuilder",
  "ArithSourceConfig",
  "ArithSpec",
  "Gsm8kBuilder",
  "HumanEvalBuilder",
  "JsonlPromptsBuilder",
  "JsonlSourceConfig",
  "PromptSource",
  "PromptStream",
  "default_path",
  "file_sha256",
  "load_prompt_source",
  "prepare_builder",
]

_logger = logging.getLogger(__name__)

KINDS = ("gsm8k", "humaneval", "jsonl", "arith")

HUMANEVAL_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
GSM8K_FIELDS = ("question", "answer")
DEFAULT_FIELD_MAP: Mapping[str, str] = {"prompt": "prompt", "answer": "answer"}

_HUMANEVAL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "humaneval")

# Bumped whenever what a builder writes changes, so old caches are not reused.
# 2: BOM accepted, lone surrogates and over-deep rows skipped, malformed_by_kind stored; 3: a generic JSONL's
# answer given as a JSON number is kept (as its text)
_FORMAT_VERSION = 3
_VERSION = tfds.core.Version("1.0.0")
# Feature holding a row's 1-based line number in its source file.
LINE_FEATURE = "source_line"
# Longest excerpt of a malformed line kept in logs and metadata.
_MAX_EXCERPT = 200
# Rounds of ArithTask.sample() before giving up on finding num_rows distinct problems.
_ARITH_MAX_ROUNDS = 64
_ARITH_TAG = 0x54464453  # "TFDS": keeps the generated rows independent of other streams of the same seed


def file_sha256(path: str | os.PathLike[str]) -> str:
  """Returns the SHA-256 hex digest of a file's bytes (as stored; ``.gz`` files are not decompressed)."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def _read_lines(path: str, expected_sha256: str) -> list[bytes]:
  """Reads a (possibly gzipped) file, checks its hash and splits it into raw lines.  Gzip is told by its
  magic bytes, not the name (as the direct readers do: a gzipped ``.jsonl`` loads either way)."""
  with open(path, "rb") as f:
    raw = f.read()
  actual = hashlib.sha256(raw).hexdigest()
  if actual != expected_sha256:
    raise RuntimeError(f"{path} changed while its dataset was being prepared (sha256 {actual} != {expected_sha256})")
  if raw[:2] == b"\x1f\x8b":
    raw = gzip.decompress(raw)
  return raw.split(b"\n")


def _config_name(payload: Mapping[str, Any]) -> str:
  """A short, stable hash of a JSON-able config description (used as the TFDS config name)."""
  text = json.dumps({"format": _FORMAT_VERSION, **payload}, sort_keys=True)
  return "h" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


# ---- JSONL builders ---------------------------------------------------------------------


@dataclasses.dataclass
class JsonlSourceConfig(tfds.core.BuilderConfig):
  """Which files a JSONL builder reads, and how its fields are named.

  Build one with :meth:`create`, which hashes the files; the config's ``name`` (and thus
  its cache directory) is derived from that hash and the field map.

  Attributes:
    split_files: ``(split, path)`` pairs.
    split_hashes: ``(split, sha256)`` pairs, the hash of each file when the config was made.
    field_map: ``(feature, json_key)`` pairs; only :class:`JsonlPromptsBuilder` uses them.
  """

  split_files: tuple[tuple[str, str], ...] = ()
  split_hashes: tuple[tuple[str, str], ...] = ()
  field_map: tuple[tuple[str, str], ...] = ()

  @classmethod
  def create(
    cls,
    builder_name: str,
    split_files: Mapping[str, str | os.PathLike[str]],
    field_map: Mapping[str, str] | None = None,
  ) -> JsonlSourceConfig:
    """Makes a config for ``split_files``, hashing every file now.

    Args:
      builder_name: the builder's TFDS name (part of the hash).
      split_files: split name to JSONL path (``.gz`` allowed).
      field_map: feature name to JSON key, for :class:`JsonlPromptsBuilder`.

    Returns:
      The config.

    Raises:
      ValueError: on no splits or an invalid field map.
      FileNotFoundError: if a file does not exist.
    """
    if not split_files:
      raise ValueError("split_files must name at least one split")
    files = tuple(sorted((str(split), os.path.abspath(os.fspath(path))) for split, path in split_files.items()))
    for split, path in files:
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{builder_name}: no file for split {split!r} at {path}")
    hashes = tuple((split, file_sha256(path)) for split, path in files)
    fields = tuple(sorted(_check_field_map(field_map).items())) if field_map is not None else ()
    name = _config_name({"builder": builder_name, "splits": dict(hashes), "field_map": [list(f) for f in fields]})
    return cls(name=name, split_files=files, split_hashes=hashes, field_map=fields)


def _check_field_map(field_map: Mapping[str, str]) -> dict[str, str]:
  out = dict(field_map)
  if not out:
    raise ValueError("field_map must map at least one feature to a JSON key")
  for feature, key in out.items():
    if not isinstance(feature, str) or not feature.isidentifier():
      raise ValueError(f"field_map feature names must be identifiers, got {feature!r}")
    if feature == LINE_FEATURE:
      raise ValueError(f"field_map must not define {LINE_FEATURE!r}: it holds the source line number")
    if not isinstance(key, str) or not key:
      raise ValueError(f"field_map[{feature!r}] must be a non-empty JSON key, got {key!r}")
  return out


def _number_text(value: Any) -> str | None:
  """A finite JSON number (not a boolean) as text (``18``, ``2.5``); None for anything else."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return str(value)


def _parse_row(
  raw: bytes, fields: Mapping[str, str], *, first_line: bool = False, numbers: Iterable[str] = ()
) -> tuple[dict[str, str] | None, Malformed | None]:
  """Parses one raw line into ``{feature: text}``; returns ``(row, None)`` or ``(None, Malformed)``.  The
  features in ``numbers`` may also be given as JSON numbers (``"answer": 18``), kept as their text."""
  obj, problem = parse_json_object(raw, first_line=first_line)
  if problem is None:
    assert obj is not None
    for feature in numbers:
      key = fields.get(feature)
      if key is not None and (text := _number_text(obj.get(key))) is not None:
        obj[key] = text
    problem = check_string_fields(obj, fields.values())
  if problem is not None:
    return None, problem
  assert obj is not None
  return {feature: obj[key] for feature, key in fields.items()}, None


class _JsonlBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Shared logic: read, validate and write the rows of one JSONL file per split."""

  VERSION = _VERSION
  # Features a row may give as a JSON number (kept as its text); the others must be strings.
  NUMBER_FEATURES: tuple[str, ...] = ()

  def _fields(self) -> dict[str, str]:
    """Feature name to JSON key."""
    raise NotImplementedError

  def _check_row(self, row: dict[str, str]) -> str:
    """A kind-specific check of a parsed row: "" if usable, else the reason it is not."""
    del row
    return ""

  def _info(self) -> tfds.core.DatasetInfo:
    features = {name: tfds.features.Text() for name in self._fields()}
    features[LINE_FEATURE] = tfds.features.Scalar(dtype=np.int64)
    return tfds.core.DatasetInfo(
      builder=self,
      description=f"{self.name}: rows of local JSON-lines files, in file order.",
      features=tfds.features.FeaturesDict(features),
      disable_shuffling=True,
      metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict[str, Any]]]]:
    del dl_manager  # local files only
    config: JsonlSourceConfig = self.builder_config
    hashes = dict(config.split_hashes)
    fields = self._fields()
    splits_meta: dict[str, Any] = {}
    generators = {}
    for split, path in config.split_files:
      rows, meta = self._read_split(split, path, hashes[split], fields)
      splits_meta[split] = meta
      generators[split] = self._generate_examples(rows)
    self.info.metadata["splits"] = splits_meta
    self.info.metadata["field_map"] = fields
    return generators

  def _read_split(
    self, split: str, path: str, sha256: str, fields: Mapping[str, str]
  ) -> tuple[list[tuple[int, dict[str, str]]], dict[str, Any]]:
    rows: list[tuple[int, dict[str, str]]] = []
    by_kind: dict[str, int] = {}
    first_bad: dict[str, Any] | None = None
    for lineno, raw in enumerate(_read_lines(path, sha256), start=1):
      if not raw.strip():
        continue
      row, problem = _parse_row(raw, fields, first_line=lineno == 1, numbers=self.NUMBER_FEATURES)
      if row is not None:
        reason = self._check_row(row)
        problem = Malformed("failed_check", reason) if reason else None
      if problem is not None:
        by_kind[problem.kind] = by_kind.get(problem.kind, 0) + 1
        if first_bad is None:
          excerpt = raw[:_MAX_EXCERPT].decode("utf-8", errors="replace")
          first_bad = {"line": lineno, "kind": problem.kind, "reason": problem.reason, "text": excerpt}
        continue
      assert row is not None
      rows.append((lineno, row))
    num_bad = sum(by_kind.values())
    if first_bad is not None:
      _logger.warning(
        "%s (%s split %r): skipped %d malformed row(s) of %d (%s); first at line %d: %s: %r",
        path,
        self.name,
        split,
        num_bad,
        num_bad + len(rows),
        describe_kinds(by_kind),
        first_bad["line"],
        first_bad["reason"],
        first_bad["text"],
      )
    if not rows:
      kinds = f": {describe_kinds(by_kind)}" if by_kind else ""
      raise ValueError(f"{path}: no usable {self.name} rows for split {split!r} ({num_bad} malformed){kinds}")
    meta = {
      "path": path,
      "sha256": sha256,
      "num_rows": len(rows),
      "num_malformed": num_bad,
      "malformed_by_kind": by_kind,
      "first_malformed": first_bad,
    }
    return rows, meta

  def _generate_examples(self, rows: list[tuple[int, dict[str, str]]]) -> Iterator[tuple[int, dict[str, Any]]]:  # type: ignore[override]
    for lineno, row in rows:
      yield lineno, {**row, LINE_FEATURE: lineno}


class Gsm8kBuilder(_JsonlBuilder, skip_registration=True):
  """GSM8K JSONL files: ``question`` and ``answer`` (a solution ending in ``#### <number>``)."""

  name = "mimo_gsm8k"

  def _fields(self) -> dict[str, str]:
    return {key: key for key in GSM8K_FIELDS}

  def _check_row(self, row: dict[str, str]) -> str:
    return "" if gold_answer(row["answer"]) is not None else "answer has no '#### <number>' final answer"


class HumanEvalBuilder(_JsonlBuilder, skip_registration=True):
  """HumanEval JSONL(.gz) files: the string fields in :data:`HUMANEVAL_FIELDS`."""

  name = "mimo_humaneval"

  def _fields(self) -> dict[str, str]:
    return {key: key for key in HUMANEVAL_FIELDS}


class JsonlPromptsBuilder(_JsonlBuilder, skip_registration=True):
  """Any JSONL file; the config's ``field_map`` says which fields to keep and how to name them: strings,
  and the answer a string or a JSON number (``"answer": 18``)."""

  name = "mimo_jsonl_prompts"
  NUMBER_FEATURES = ("answer",)

  def _fields(self) -> dict[str, str]:
    config: JsonlSourceConfig = self.builder_config
    if not config.field_map:
      raise ValueError(f"{self.name} needs a config with a field_map")
    return dict(config.field_map)


# ---- synthetic arithmetic ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ArithSpec:
  """The synthetic arithmetic source: which :class:`~mimo_jax.tasks.arith.ArithTask` and how many rows.

  Attributes:
    levels: the task's levels.
    seed: the task's seed (held-out split and generated training rows).
    num_rows: distinct training problems to generate.
    heldout_size: held-out problems (the ``test`` split); 0 means no ``test`` split.
    reverse_answer: passed to the task.
  """

  levels: tuple[int, ...] = (1, 2)
  seed: int = 0
  num_rows: int = 1024
  heldout_size: int = 256
  reverse_answer: bool = False

  def to_json(self) -> dict[str, Any]:
    """A JSON-able description (levels as a sorted list)."""
    out = dataclasses.asdict(self)
    out["levels"] = sorted(int(x) for x in self.levels)
    return out


@dataclasses.dataclass
class ArithSourceConfig(tfds.core.BuilderConfig):
  """Builder config of :class:`ArithBuilder`; make one with :meth:`create`.

  Attributes:
    spec: the JSON description of an :class:`ArithSpec`.
  """

  spec: tuple[tuple[str, Any], ...] = ()

  @classmethod
  def create(cls, spec: ArithSpec) -> ArithSourceConfig:
    """Makes the config for ``spec``; its name hashes the spec."""
    if spec.num_rows <= 0:
      raise ValueError(f"num_rows must be positive, got {spec.num_rows}")
    data = spec.to_json()
    return cls(
      name=_config_name({"builder": ArithBuilder.name, "spec": data}),
      spec=tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(data.items())),
    )


class ArithBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Rows of :class:`~mimo_jax.tasks.arith.ArithTask`: ``prompt``, ``answer``, ``task``, ``uid`` and ``level``."""

  name = "mimo_arith"
  VERSION = _VERSION

  def _spec(self) -> ArithSpec:
    return ArithSpec(**dict(self.builder_config.spec))

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description="Synthetic multi-digit addition problems (mimo_jax.tasks.arith).",
      features=tfds.features.FeaturesDict(
        {
          "prompt": tfds.features.Text(),
          "answer": tfds.features.Text(),
          "task": tfds.features.Text(),
          "uid": tfds.features.Text(),
          "level": tfds.features.Scalar(dtype=np.int64),
        }
      ),
      disable_shuffling=True,
      metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict[str, Any]]]]:
    del dl_manager
    spec = self._spec()
    task = ArithTask(spec.levels, seed=spec.seed, heldout_size=spec.heldout_size, reverse_answer=spec.reverse_answer)
    rng = np.random.default_rng([_ARITH_TAG, spec.seed])
    splits = {"train": task.sample_distinct(rng, spec.num_rows, max_rounds=_ARITH_MAX_ROUNDS)}
    if spec.heldout_size > 0:
      splits["test"] = task.heldout()
    self.info.metadata["spec"] = spec.to_json()
    self.info.metadata["splits"] = {
      split: {"num_rows": len(rows), "num_malformed": 0, "malformed_by_kind": {}, "first_malformed": None}
      for split, rows in splits.items()
    }
    return {split: self._generate_examples(rows) for split, rows in splits.items()}

  def _generate_examples(self, problems: list[Any]) -> Iterator[tuple[int, dict[str, Any]]]:  # type: ignore[override]
    for i, p in enumerate(problems):
      yield i, {"prompt": p.prompt, "answer": p.answer, "task": p.task, "uid": p.uid, "level": p.level}


# ---- loading ----------------------------------------------------------------------------

_BUILDERS: dict[str, type[tfds.core.GeneratorBasedBuilder]] = {
  "gsm8k": Gsm8kBuilder,
  "humaneval": HumanEvalBuilder,
  "jsonl": JsonlPromptsBuilder,
  "arith": ArithBuilder,
}


def default_path(kind: str, split: str) -> str:
  """The file a ``kind`` reads for ``split`` when no path is given (the shipped samples).

  Args:
    kind: ``"gsm8k"`` or ``"humaneval"``.
    split: ``"train"`` or ``"test"``.

  Returns:
    The path (it may not exist, e.g. before the HumanEval sample is shipped).

  Raises:
    ValueError: for another kind or split.
  """
  if split not in ("train", "test"):
    raise ValueError(f"{kind} has default files only for splits 'train' and 'test', got {split!r}")
  if kind == "gsm8k":
    return GSM8K_TRAIN_PATH if split == "train" else GSM8K_TEST_PATH
  if kind == "humaneval":
    return os.path.join(_HUMANEVAL_DIR, f"{split}_sample.jsonl")
  raise ValueError(f"{kind!r} sources have no default file; pass a path")


def prepare_builder(
  kind: str,
  data_dir: str | os.PathLike[str],
  *,
  split_files: Mapping[str, str | os.PathLike[str]] | None = None,
  field_map: Mapping[str, str] | None = None,
  arith: ArithSpec | None = None,
) -> tfds.core.GeneratorBasedBuilder:
  """Returns a prepared builder of ``kind`` in ``data_dir``, building it unless its cache exists.

  Args:
    kind: one of :data:`KINDS`.
    data_dir: the TFDS data directory (created if needed).
    split_files: split to file, for the JSONL kinds; gsm8k and humaneval default to both
      shipped samples.  Must be None for ``"arith"``.
    field_map: feature to JSON key, only for ``"jsonl"`` (default ``{"prompt": "prompt",
      "answer": "answer"}``).
    arith: the arithmetic source, only for ``"arith"`` (default :class:`ArithSpec()`).

  Returns:
    The builder; read it with ``builder.as_data_source(split)`` or :class:`PromptSource`.

  Raises:
    ValueError: on an unknown kind, arguments that do not belong to it, or a split
      without usable rows.
    FileNotFoundError: if a source file is missing.
  """
  if kind not in _BUILDERS:
    raise ValueError(f"unknown source kind {kind!r}; known kinds are {list(KINDS)}")
  if field_map is not None and kind != "jsonl":
    raise ValueError(f"field_map applies only to 'jsonl' sources, not {kind!r}")
  if arith is not None and kind != "arith":
    raise ValueError(f"arith applies only to 'arith' sources, not {kind!r}")
  cls = _BUILDERS[kind]
  if kind == "arith":
    if split_files is not None:
      raise ValueError("'arith' sources are generated, not read from files")
    config: tfds.core.BuilderConfig = ArithSourceConfig.create(arith if arith is not None else ArithSpec())
  else:
    if split_files is None:
      if kind == "jsonl":
        raise ValueError("'jsonl' sources need split_files")
      split_files = {split: default_path(kind, split) for split in ("train", "test")}
    if kind == "jsonl" and field_map is None:
      field_map = DEFAULT_FIELD_MAP
    config = JsonlSourceConfig.create(cls.name, split_files, field_map if kind == "jsonl" else None)
  builder = cls(data_dir=os.fspath(data_dir), config=config, file_format="array_record")
  builder.download_and_prepare(
    file_format="array_record",
    download_config=tfds.download.DownloadConfig(
      try_download_gcs=False, compute_stats=tfds.download.ComputeStatsMode.SKIP
    ),
  )
  return builder


class PromptSource:
  """Random access to one split of a prepared source, decoded to Python values.

  Text features are returned as ``str`` and integer features as ``int``.

  Args:
    builder: a prepared builder (see :func:`prepare_builder`).
    split: the split to read.
    name: the source's name (default ``"<builder>:<split>"``).

  Attributes:
    name: the source's name, e.g. ``"gsm8k:train"``.
    split: the split.
    num_malformed: rows of the source file that were skipped as malformed.
    malformed_by_kind: ``{kind: count}`` of the skipped rows (see
      :data:`mimo_jax.tasks.splits.MALFORMED_KINDS`).
    first_malformed: ``{"line", "kind", "reason", "text"}`` of the first skipped row, or None.
    path: the source file (None for generated sources).
    features: the feature names of every row.
  """

  def __init__(self, builder: tfds.core.DatasetBuilder, split: str, *, name: str | None = None) -> None:
    meta = dict(builder.info.metadata or {}).get("splits", {})
    if split not in meta or split not in builder.info.splits:
      raise ValueError(f"{builder.name} has no split {split!r}; it has {sorted(builder.info.splits)}")
    self._builder = builder
    self._source = builder.as_data_source(split=split)
    self.split = split
    self.name = name or f"{builder.name}:{split}"
    split_meta = meta[split]
    self.num_malformed: int = int(split_meta.get("num_malformed", 0))
    self.malformed_by_kind: dict[str, int] = dict(split_meta.get("malformed_by_kind") or {})
    self.first_malformed: dict[str, Any] | None = split_meta.get("first_malformed")
    self.path: str | None = split_meta.get("path")
    self.features: tuple[str, ...] = tuple(builder.info.features.keys())
    if self.num_malformed:
      _logger.warning(
        "%s: %d malformed row(s) of %s were skipped (%s); first: %s",
        self.name,
        self.num_malformed,
        self.path,
        describe_kinds(self.malformed_by_kind),
        self.first_malformed,
      )

  @property
  def builder(self) -> tfds.core.DatasetBuilder:
    """The underlying TFDS builder."""
    return self._builder

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> dict[str, Any]:
    i = operator.index(index)
    n = len(self._source)
    if i < 0:
      i += n
    if not 0 <= i < n:
      raise IndexError(f"index {index} out of range for {self.name} with {n} rows")
    row = _decode(self._source[i])
    if any(value is None for value in row.values()):
      # A shard cut at a block boundary reads back rows of nothing rather than failing.
      raise RuntimeError(
        f"{self.name}: row {i} of the prepared dataset in {self._builder.data_dir} reads back empty (a damaged "
        "cache); delete that directory to have it built again"
      )
    return row

  def __iter__(self) -> Iterator[dict[str, Any]]:
    for i in range(len(self)):
      yield self[i]

  def __repr__(self) -> str:
    return f"PromptSource({self.name!r}, rows={len(self)}, malformed={self.num_malformed})"


def _decode(record: Mapping[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for key, value in record.items():
    if isinstance(value, bytes):
      out[key] = value.decode("utf-8")
    elif isinstance(value, np.generic):
      out[key] = value.item()
    else:
      out[key] = value
  return out


def load_prompt_source(
  kind: str,
  path: str | os.PathLike[str] | None,
  data_dir: str | os.PathLike[str],
  *,
  split: str,
  field_map: Mapping[str, str] | None = None,
  arith: ArithSpec | None = None,
) -> PromptSource:
  """Builds (or reuses) one split of a source in ``data_dir`` and opens it for random access.

  Args:
    kind: ``"gsm8k"``, ``"humaneval"``, ``"jsonl"`` or ``"arith"``.
    path: the JSONL file of this split; None means the shipped sample for gsm8k and
      humaneval (see :func:`default_path`); required for ``"jsonl"``; must be None for
      ``"arith"``.
    data_dir: the TFDS data directory (the cache).
    split: the split name (``"train"``/``"test"`` for defaults and for ``"arith"``; any
      name for an explicit path).
    field_map: feature to JSON key, for ``"jsonl"`` only.
    arith: the arithmetic source, for ``"arith"`` only.

  Returns:
    The opened split.

  Raises:
    ValueError: on bad arguments or a file without usable rows (the message names it).
    FileNotFoundError: if the file does not exist.
  """
  if kind not in _BUILDERS:
    raise ValueError(f"unknown source kind {kind!r}; known kinds are {list(KINDS)}")
  if kind == "arith":
    if path is not None:
      raise ValueError("'arith' sources are generated; path must be None")
    builder = prepare_builder(kind, data_dir, arith=arith)
  else:
    if path is None:
      if kind == "jsonl":
        raise ValueError("'jsonl' sources need a path")
      path = default_path(kind, split)
    builder = prepare_builder(kind, data_dir, split_files={split: path}, field_map=field_map, arith=arith)
  return PromptSource(builder, split, name=f"{kind}:{split}")
