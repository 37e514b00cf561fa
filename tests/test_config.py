"""Flags and config validation: every flagfile parses, bad input is named before compute."""

import dataclasses
import glob
import os

import jax
import pytest

from mimo_jax.config import CONCERN_CLASSES, Config, ConfigError, validate
from mimo_jax.main import main, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGFILES = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.flags")))


def test_there_are_flagfiles():
  assert FLAGFILES


@pytest.mark.parametrize("path", FLAGFILES, ids=os.path.basename)
def test_every_flagfile_parses_and_validates(path):
  cfg = parse_config(["prog", f"--flagfile={path}"])
  assert isinstance(cfg, Config)
  validate(cfg, jax.device_count())


def test_flag_names_are_unique_across_concerns():
  names = [f.name for cls in CONCERN_CLASSES.values() for f in dataclasses.fields(cls)]
  assert len(names) == len(set(names))


def test_later_flags_override_flagfile():
  path = os.path.join(ROOT, "experiments", "smoke_tiny.flags")
  cfg = parse_config(["prog", f"--flagfile={path}", "--seed=7"])
  assert cfg.run.seed == 7 and cfg.model.model_preset == "tiny"


def test_defaults_build():
  cfg = parse_config(["prog"])
  assert cfg == Config()


@pytest.mark.parametrize(
  "argv, pattern",
  [
    (["--no_such_flag=1"], "no_such_flag"),
    (["--seed=abc"], "seed.*abc"),
    (["--model_preset=huge"], r"model_preset.*tiny\|demo\|small\|1b\|7b\|13b"),
    (["--loss_agg=sum"], "loss_agg.*token-mean"),
    (["--top_p=1.5"], r"--top_p=1\.5.*\(0, 1\]"),
    (["--clip_c=0.5"], r"--clip_c=0\.5.*must be > 1"),
    (["--prompt_buckets=64,abc"], "prompt_buckets.*comma-separated list of integers"),
    (["--advantage=gae"], "gae needs a value model"),
    (["extra_positional"], "unexpected positional"),
  ],
)
def test_bad_flags_fail_with_a_named_error(argv, pattern):
  with pytest.raises(ConfigError, match=pattern):
    parse_config(["prog", *argv])


@pytest.mark.parametrize(
  "argv, pattern",
  [
    # tiny has 4 heads: tensor parallel 8 does not divide them.
    (["--mesh_fsdp=1", "--mesh_tensor=8"], "mesh_tensor=8.*must divide the number of attention heads \\(4\\)"),
    (["--mesh_fsdp=3"], "mesh has 3 devices but 8"),
    (["--num_samples=1"], "num_samples=1.*at least 2 samples"),
    (["--num_minibatches=3"], "num_minibatches=3.*must divide"),
    (["--max_new_tokens=1000"], "max_new_tokens=1000.*exceeds the model's max_seq_len"),
  ],
)
def test_incompatible_combinations_fail_validation(argv, pattern):
  cfg = parse_config(["prog", *argv])
  with pytest.raises(ConfigError, match=pattern):
    validate(cfg, 8)


def test_main_reports_config_errors_without_running(capsys):
  assert main(["prog", "--mesh_tensor=8", "--mesh_fsdp=1"]) == 2
  assert "mesh_tensor" in capsys.readouterr().err


def test_main_help(capsys):
  assert main(["prog", "--help"]) == 0
  out = capsys.readouterr().out
  assert "--model_preset" in out and "--learning_rate" in out


def test_main_smoke_run(capsys):
  path = os.path.join(ROOT, "experiments", "smoke_tiny.flags")
  assert main(["prog", f"--flagfile={path}"]) == 0
  out = capsys.readouterr().out
  assert "'fsdp': 8" in out and "mean_logprob" in out
