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


# ----------------------------------------------------------------------------
# Values refused up front: finiteness and ranges of every numeric field
# ----------------------------------------------------------------------------

FLOAT_FIELDS = sorted(
  f.name for cls in CONCERN_CLASSES.values() for f in dataclasses.fields(cls) if isinstance(f.default, float)
)


def test_there_are_float_fields():
  assert "learning_rate" in FLOAT_FIELDS and len(FLOAT_FIELDS) > 30


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_every_float_flag_refuses_non_finite_values(name, value):
  with pytest.raises(ConfigError, match=rf"--{name}=(inf|-inf|nan): must be a finite number"):
    parse_config(["prog", f"--{name}={value}"])


def test_non_finite_learning_rate_message_names_the_range():
  with pytest.raises(ConfigError) as e:
    parse_config(["prog", "--learning_rate=inf"])
  assert str(e.value) == "--learning_rate=inf: must be a finite number (> 0)"


def test_every_declared_default_is_inside_its_range():
  from mimo_jax.config_base import field_range

  for cls in CONCERN_CLASSES.values():
    for f in dataclasses.fields(cls):
      allowed = field_range(f)
      if allowed is not None:
        assert allowed.contains(f.default), (cls.__name__, f.name, f.default, allowed.describe())


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--learning_rate=0"], "--learning_rate=0.0: must be > 0"),
    (["--learning_rate=-1e-5"], "--learning_rate=-1e-05: must be > 0"),
    (["--sft_learning_rate=0"], "--sft_learning_rate=0.0: must be > 0"),
    (["--weight_decay=-0.1"], "--weight_decay=-0.1: must be >= 0"),
    (["--adam_b2=1"], "--adam_b2=1.0: must be in [0, 1)"),
    (["--top_p=0"], "--top_p=0.0: must be in (0, 1]"),
    (["--gae_lambda=1.5"], "--gae_lambda=1.5: must be in [0, 1]"),
    (["--reward_clip_low=-0.1"], "--reward_clip_low=-0.1: must be in [0, 0.5)"),
    (["--sft_wrong_fraction=1.01"], "--sft_wrong_fraction=1.01: must be in [0, 1]"),
    (["--format_reward_weight=-1"], "--format_reward_weight=-1.0: must be >= 0"),
    (["--reward_model_weight=-0.5"], "--reward_model_weight=-0.5: must be >= 0"),
    (["--entropy_target=-1"], "--entropy_target=-1.0: must be >= 0"),
    (["--rollback_lr_factor=0"], "--rollback_lr_factor=0.0: must be in (0, 1]"),
    (["--temperature_final=-0.5"], "--temperature_final=-0.5: must be -1 or >= 0"),
    (["--value_window=1"], "--value_window=1: must be 0 or >= 2"),
    (["--rollback_to=-2"], "--rollback_to=-2: must be -1 or >= 0"),
    (["--eval_temperature=0"], "--eval_temperature=0.0: must be > 0"),
    (["--kl_coef_max=0"], "--kl_coef_max=0.0: must be > 0"),
    (["--num_samples=0"], "--num_samples=0: must be >= 1"),
  ],
)
def test_out_of_range_values_are_refused_naming_flag_and_range(argv, message):
  with pytest.raises(ConfigError) as e:
    parse_config(["prog", *argv])
  assert str(e.value) == message


def test_sentinels_and_bounds_themselves_are_accepted():
  cfg = parse_config(
    ["prog", "--temperature_final=-1", "--value_window=0", "--rollback_to=-1", "--top_p=1", "--gae_lambda=0"]
  )
  assert cfg.rollout.temperature_final == -1.0 and cfg.algo.value_window == 0


@pytest.mark.parametrize("flag", ["--phase_clip_mults=inf,1,1", "--phase_kl_mults=1,nan,1", "--curriculum_band=0,inf"])
def test_float_list_flags_refuse_non_finite_entries(flag):
  with pytest.raises(ConfigError, match=rf"{flag.split('=')[0]}=.*(finite|0 <= low < high <= 1)"):
    parse_config(["prog", flag])


def test_direct_construction_is_checked_too():
  from mimo_jax.config import OptimConfig

  with pytest.raises(ConfigError, match=r"--learning_rate=nan: must be a finite number \(> 0\)"):
    OptimConfig(learning_rate=float("nan"))
  with pytest.raises(ConfigError, match=r"--weight_decay='0.1': must be a number"):
    OptimConfig(weight_decay="0.1")


def test_help_shows_the_allowed_range():
  from mimo_jax.main import help_text

  text = help_text()
  assert "Allowed: > 0." in text and "Allowed: in (0, 1]." in text


def test_main_refuses_non_finite_flag_without_running(capsys):
  assert main(["prog", "--learning_rate=inf"]) == 2
  assert "--learning_rate=inf: must be a finite number (> 0)" in capsys.readouterr().err


# ----------------------------------------------------------------------------
# Flagfiles that are not UTF-8
# ----------------------------------------------------------------------------


def test_latin1_flagfile_is_refused_naming_file_and_byte(tmp_path):
  path = tmp_path / "latin1.flags"
  path.write_bytes("--seed=3\n--experiment=caf\u00e9\n".encode("latin-1"))
  with pytest.raises(ConfigError) as e:
    parse_config(["prog", f"--flagfile={path}"])
  message = str(e.value)
  assert f"--flagfile={path}" in message
  assert "not valid UTF-8 at byte 25 (line 2, column 17: byte(s) 0xe9" in message


def test_nested_latin1_flagfile_is_refused_naming_both_files(tmp_path):
  inner = tmp_path / "inner.flags"
  inner.write_bytes(b"# comment\n--experiment=\xe9t\xe9\n")
  outer = tmp_path / "outer.flags"
  outer.write_text(f"--seed=1\n--flagfile={inner}\n", encoding="utf-8")
  with pytest.raises(ConfigError, match=rf"--flagfile={inner} \(included from {outer}\): not valid UTF-8 at byte 23"):
    parse_config(["prog", "--flagfile", str(outer)])


def test_commented_out_flagfile_lines_are_not_followed(tmp_path):
  bad = tmp_path / "bad.flags"
  bad.write_bytes(b"--experiment=\xff\n")
  good = tmp_path / "good.flags"
  good.write_text(f"# --flagfile={bad}\n--experiment=caf\u00e9\n", encoding="utf-8")
  assert parse_config(["prog", f"--flagfile={good}"]).run.experiment == "caf\u00e9"


def test_flagfile_with_byte_order_mark_is_refused(tmp_path):
  path = tmp_path / "bom.flags"
  path.write_bytes(b"\xef\xbb\xbf--seed=3\n")
  with pytest.raises(ConfigError, match="byte-order mark"):
    parse_config(["prog", f"--flagfile={path}"])


def test_main_reports_bad_flagfile_without_traceback(tmp_path, capsys):
  path = tmp_path / "latin1.flags"
  path.write_bytes(b"--experiment=\xe9\n")
  assert main(["prog", f"--flagfile={path}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --flagfile=") and "byte 13" in err and "Traceback" not in err


def test_the_adaptive_kl_controller_accepts_the_default_coefficient_and_moves_it():
  """The default --kl_coef (0.001) must lie inside the controller's default bounds, and move both ways."""
  from mimo_jax.rl.controllers import adaptive_kl_coef

  flagfile = os.path.join(ROOT, "experiments", "grpo_tiny.flags")
  for controller in ("adaptive", "budget"):
    cfg = parse_config(["prog", f"--flagfile={flagfile}", f"--kl_controller={controller}"])
    validate(cfg, 8)
    a = cfg.algo
    assert a.kl_coef_min < a.kl_coef == 0.001 < a.kl_coef_max
  up = adaptive_kl_coef(0.001, 1.0, target=0.02, n=128, horizon=1000, beta_min=a.kl_coef_min, beta_max=a.kl_coef_max)
  down = adaptive_kl_coef(0.001, 0.0, target=0.02, n=128, horizon=1000, beta_min=a.kl_coef_min, beta_max=a.kl_coef_max)
  assert float(down) < 0.001 < float(up)
