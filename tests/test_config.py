"""Flags and config validation: every flagfile parses, bad input is named before compute."""

import dataclasses
import glob
import json
import os
import re

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
    (["--num_processes=2", "--process_id=2", "--coordinator_address=h:1"], r"--process_id=2.*must be in \[0, 2\)"),
    (["--num_processes=2", "--process_id=1"], "coordinator_address.*required.*num_processes > 1"),
    (["--heartbeat_timeout_s=0"], "heartbeat_timeout_s=0.*>= 1"),
    (["--data_order=epochs"], r"data_order.*sample\|shuffle\|sequential"),
    (["--data_order=shuffle"], "data_order='shuffle'.*needs --train_prompts=N with --task=arith"),
    (
      ["--data_order=sequential", "--train_prompts=16", "--curriculum"],
      "data_order.*does not combine with --curriculum",
    ),
    (["--train_prompts=16", "--task=arith:0.5,gsm8k:0.5"], "train_prompts=16.*does not combine with a mixture"),
    (["--train_prompts=-1"], "train_prompts=-1.*>= 0"),
    (["--task=humaneval", "--reward_timeout_s=2"], "reward_timeout_s=2.0: must be >= 3 with humaneval"),
    (["--format_reward_weight=5"], "format_reward_weight=5.0: is the gsm8k task's component; --task=arith has no"),
    (
      ["--curriculum", "--curriculum_pool=4", "--prompts_per_step=8"],
      "curriculum_pool=4: must hold at least --prompts_per_step=8",
    ),
    (
      ["--entropy_controller=adaptive", "--entropy_coef=0.2", "--entropy_coef_max=0.05"],
      "entropy_coef=0.2: a controlled coefficient starts at most --entropy_coef_max=0.05",
    ),
    # Without a critic the policy would only wait, silently, through the "value" warm-up.
    (["--value_warmup_steps=5"], "value_warmup_steps=5: warms up a value model .--use_value_model.; without one"),
    # A Hugging Face checkpoint brings its own vocabulary and length: flags for them would be ignored.
    (["--hf_checkpoint=ckpt", "--vocab_size=4096"], "vocab_size=4096.*leave --vocab_size at 0"),
    (["--hf_checkpoint=ckpt", "--max_seq_len=4096"], "max_seq_len=4096.*leave --max_seq_len at 0"),
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
    # A length set on the command line is checked as the preset's is.
    (["--max_seq_len=256", "--max_new_tokens=1000"], "max_new_tokens=1000.*= 1128 exceeds the model's max_seq_len 256"),
    (["--temperature=0"], "temperature=0.0: greedy samples of a prompt are all alike, so group advantages"),
    (["--keep_best=greedy_accuracy", "--eval_prompts=0"], "keep_best='greedy_accuracy': needs held-out evaluations"),
    (
      ["--task=humaneval", "--keep_best=maj@8", "--eval_samples=8"],
      r"keep_best='maj@8': maj@K needs an answer to vote on, which only arith, gsm8k extract \(not humaneval\)",
    ),
  ],
)
def test_incompatible_combinations_fail_validation(argv, pattern):
  cfg = parse_config(["prog", *argv])
  with pytest.raises(ConfigError, match=pattern):
    validate(cfg, 8)


def test_the_combinations_beside_those_refused_pass_validation():
  # Annealed from greedy, PPO greedy (no groups), a length inside a set limit, maj@K on tasks that vote.
  for argv in (
    ["--temperature=0", "--temperature_final=1"],
    ["--temperature=0", "--advantage=gae", "--use_value_model"],
    ["--max_seq_len=256", "--max_new_tokens=128"],
    ["--task=arith:0.5,gsm8k:0.5", "--keep_best=maj@8", "--eval_samples=8"],
  ):
    validate(parse_config(["prog", *argv]), 8)


def test_a_hugging_face_checkpoints_length_bounds_the_sequences(tmp_path):
  """Its ``max_position_embeddings`` (from ``config.json``, before any weight is read) bounds the
  longest prompt bucket plus ``--max_new_tokens``, as a preset's length does."""
  (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 160}))
  argv = ["prog", f"--hf_checkpoint={tmp_path}", "--prompt_buckets=96"]
  validate(parse_config([*argv, "--max_new_tokens=64"]), 8)
  with pytest.raises(ConfigError, match="max_new_tokens=65.*= 161 exceeds the model's max_seq_len 160"):
    validate(parse_config([*argv, "--max_new_tokens=65"]), 8)


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_vocabulary_smaller_than_the_tokenizers_is_refused_before_any_compute(tmp_path, capsys, dry_run):
  # Token ids past the embedding would read NaN rows (the gather's fill): every logit NaN.  The dry
  # run plans the same run, so it refuses it too (it took --vocab_size as given).
  run_dir = tmp_path / "run"
  argv = ["prog", "--model_preset=tiny", "--vocab_size=8", f"--run_dir={run_dir}", f"--dry_run={dry_run}"]
  assert main(argv) == 2
  assert re.search(r"--vocab_size=8: is smaller than the tokenizer's \d+ tokens", capsys.readouterr().err)
  assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()
  assert not (run_dir / "dry_run.json").exists()


def test_a_reward_model_flag_that_names_no_reward_model_run_is_refused_before_any_compute(tmp_path, capsys):
  run_dir = tmp_path / "run"
  argv = ["prog", "--model_preset=tiny", f"--reward_model={tmp_path / 'none'}", f"--run_dir={run_dir}"]
  assert main(argv) == 2
  assert "--reward_model=" in capsys.readouterr().err
  assert not (run_dir / "checkpoints").exists()


def test_main_reports_config_errors_without_running(capsys):
  assert main(["prog", "--mesh_tensor=8", "--mesh_fsdp=1"]) == 2
  assert "mesh_tensor" in capsys.readouterr().err


def test_more_train_prompts_than_the_file_holds_is_refused_before_any_compute(tmp_path, capsys):
  # The shipped GSM8K training sample is far smaller; the task's size is known once its file is read.
  run_dir = tmp_path / "run"
  argv = ["prog", "--task=gsm8k", "--train_prompts=100000", "--model_preset=tiny", f"--run_dir={run_dir}"]
  assert main(argv) == 2
  assert re.search(r"--train_prompts=100000: the task has \d+ training prompts", capsys.readouterr().err)
  assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


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
      values = f.default if f.metadata.get("items") is not None else (f.default,)
      if allowed is not None:
        for v in values:
          assert allowed.contains(v), (cls.__name__, f.name, f.default, allowed.describe())


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
    (["--digit_reward_weight=-1"], "--digit_reward_weight=-1.0: must be >= 0"),
    (
      ["--task=gsm8k", "--digit_reward_weight=1"],
      "--digit_reward_weight=1.0: is the arithmetic task's component; --task=gsm8k has no arith",
    ),
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


# ---- list-valued settings are typed tuples, parsed once where flags are read


LIST_FIELDS = [f for cls in CONCERN_CLASSES.values() for f in dataclasses.fields(cls) if f.metadata.get("items")]


def test_there_are_list_fields():
  assert {f.name for f in LIST_FIELDS} >= {"prompt_buckets", "arith_levels", "phase_fracs", "curriculum_band"}


@pytest.mark.parametrize("f", LIST_FIELDS, ids=lambda f: f.name)
def test_every_list_field_is_a_tuple_of_its_element_type(f):
  items = f.metadata["items"]
  assert isinstance(f.default, tuple)
  assert all(type(v) is items for v in f.default), (f.name, f.default)


def test_no_setting_is_comma_separated_text():
  # A comma inside a text default means a list kept as text, to be re-parsed wherever it is
  # read.  The one mapping-valued setting (JSONL field names) is parsed by its task.
  texts = [
    f.name
    for cls in CONCERN_CLASSES.values()
    for f in dataclasses.fields(cls)
    if isinstance(f.default, str) and "," in f.default
  ]
  assert texts == ["jsonl_fields"]


def test_list_flags_become_tuples_of_numbers():
  cfg = parse_config(
    ["prog", "--prompt_buckets=128,64", "--arith_levels=3", "--phase_fracs=0.2,0.6,0.2", "--debug_nan_steps=4,7"]
  )
  assert cfg.rollout.prompt_buckets == (128, 64) and cfg.rollout.buckets == (64, 128)
  assert cfg.data.arith_levels == (3,)
  assert cfg.algo.phase_fracs == (0.2, 0.6, 0.2) and all(type(v) is float for v in cfg.algo.phase_fracs)
  assert cfg.run.debug_nan_steps == (4, 7)
  assert parse_config(["prog"]).run.debug_nan_steps == () == parse_config(["prog"]).run.debug_lr_spike_steps
  assert parse_config(["prog", "--debug_lr_spike_steps=12"]).run.debug_lr_spike_steps == (12,)
  assert parse_config(["prog", "--curriculum_band=0,1"]).data.curriculum_band == (0.0, 1.0)


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--arith_levels=1,5"], "--arith_levels='1,5': every element must be in [1, 4]"),
    (["--arith_levels="], "--arith_levels='': expected at least 1 comma-separated integers"),
    (["--prompt_buckets=0,64"], "--prompt_buckets='0,64': every element must be > 0"),
    (["--prompt_buckets=64.5"], "--prompt_buckets='64.5': expected a comma-separated list of integers"),
    (["--curriculum_band=0.7,0.4"], "--curriculum_band='0.7,0.4': expected low,high with 0 <= low < high <= 1"),
    (["--curriculum_band=0.4"], "--curriculum_band='0.4': expected exactly 2 comma-separated numbers"),
    (["--phase_smoothing=0.9,1,0.9"], "--phase_smoothing='0.9,1.0,0.9': every element must be in [0, 1)"),
    (["--phase_fracs=0.5,0.5,0.5"], "--phase_fracs='0.5,0.5,0.5': 3 fractions > 0 summing to 1"),
    (["--debug_nan_steps=0"], "--debug_nan_steps='0': every element must be >= 1"),
    (["--debug_lr_spike_steps=0"], "--debug_lr_spike_steps='0': every element must be >= 1"),
  ],
)
def test_bad_list_values_are_refused_naming_flag_and_rule(argv, message):
  with pytest.raises(ConfigError) as e:
    parse_config(["prog", *argv])
  assert str(e.value) == message


def test_direct_construction_refuses_text_for_a_list():
  from mimo_jax.config import DataConfig

  with pytest.raises(ConfigError, match=r"--arith_levels='1,2': expected a tuple of integers"):
    DataConfig(arith_levels="1,2")


def test_config_json_lists_and_old_text_both_read_back_as_tuples():
  import json

  from mimo_jax.eval.evaluator import config_from_dict

  cfg = parse_config(["prog", "--arith_levels=2,3", "--prompt_buckets=16,32"])
  d = json.loads(cfg.to_json())
  assert d["data"]["arith_levels"] == [2, 3]
  assert config_from_dict(d) == cfg
  # A run directory written when these settings were text still reads (and resumes) as the same run.
  d["data"]["arith_levels"], d["rollout"]["prompt_buckets"] = "2,3", "16,32"
  assert config_from_dict(d) == cfg


def test_a_resume_compares_list_identity_settings_by_value():
  import json

  from mimo_jax.train.rundir import identity_mismatches

  cfg = parse_config(["prog", "--arith_levels=2,3"])
  old_text = json.loads(cfg.to_json())
  old_text["data"]["arith_levels"] = "2,3"
  assert identity_mismatches(json.loads(cfg.to_json()), cfg.to_dict()) == []
  assert identity_mismatches(old_text, cfg.to_dict()) == []
  other = parse_config(["prog", "--arith_levels=1,2"]).to_dict()
  assert identity_mismatches(old_text, other) == ["--arith_levels: (2, 3) -> (1, 2)"]


# ---- method choices come from the registries that implement them


def test_method_choices_are_the_registries():
  from mimo_jax import rl
  from mimo_jax.config import AlgoConfig

  choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(AlgoConfig)}
  assert choices["advantage"] == rl.ADVANTAGES == (*rl.ADVANTAGE_ESTIMATORS, "gae")
  assert choices["policy_loss"] == tuple(rl.POLICY_LOSSES)
  assert choices["loss_agg"] == tuple(rl.AGGREGATIONS)
  assert choices["kl_estimator"] == tuple(rl.KL_ESTIMATORS)


def test_every_group_estimator_refuses_one_sample_per_prompt():
  from mimo_jax import rl

  for name in rl.ADVANTAGE_ESTIMATORS:
    with pytest.raises(ConfigError, match=rf"--num_samples=1: group advantages \({name}\)"):
      validate(parse_config(["prog", f"--advantage={name}", "--num_samples=1"]), jax.device_count())


# ---- the model's shape from flags (size sweeps, side-by-side benchmarks)


def test_shape_flags_override_the_preset_and_zero_keeps_it():
  from mimo_jax.models.config import tiny

  assert parse_config(["prog", "--model_preset=tiny"]).model.model_config() == tiny()
  cfg = parse_config(
    [
      "prog",
      "--model_preset=tiny",
      "--d_model=96",
      "--num_layers=3",
      "--num_heads=6",
      "--num_kv_heads=3",
      "--mlp_dim=160",
    ]
  ).model.model_config()
  assert (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.mlp_dim) == (96, 3, 6, 3, 160)
  assert cfg.resolved_head_dim == 16 and cfg.vocab_size == tiny().vocab_size
  # Hand count: per layer q 96*96, k and v 96*48 each, o 96*96, MLP 3*96*160, two norms 2*96;
  # untied embedding and unembedding 2*256*96, final norm 96.
  layer = 96 * 96 + 2 * 96 * 48 + 96 * 96 + 3 * 96 * 160 + 2 * 96
  assert cfg.num_params() == 3 * layer + 2 * 256 * 96 + 96
  explicit = parse_config(["prog", "--model_preset=tiny", "--head_dim=32"]).model.model_config()
  assert explicit.resolved_head_dim == 32 and explicit.d_model == 64


def test_shape_flags_build_the_model_they_name():
  import flax.nnx as nnx

  from mimo_jax.models import Transformer

  spec = parse_config(["prog", "--model_preset=tiny", "--d_model=48", "--num_layers=1", "--mlp_dim=80"]).model
  model = Transformer(spec.model_config(), rngs=nnx.Rngs(0))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count == spec.model_config().num_params() == (48 * 48 * 2 + 2 * 48 * 24 + 3 * 48 * 80 + 96) + 2 * 256 * 48 + 48


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--num_kv_heads=3"], "--num_kv_heads=3: must divide num_heads=4"),
    (["--d_model=66"], "--d_model=66: must be divisible by num_heads=4 when head_dim is not set"),
    (["--head_dim=7"], "--head_dim=7: must be even"),
    (["--num_layers=-1"], "--num_layers=-1: must be >= 0"),
    (["--mlp_dim=1.5"], "mlp_dim"),
    (["--hf_checkpoint=/some/dir", "--d_model=64"], "--d_model=64: the shape comes from --hf_checkpoint"),
  ],
)
def test_bad_shapes_are_refused_naming_the_flag(argv, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    parse_config(["prog", "--model_preset=tiny", *argv])


def test_tensor_parallel_is_checked_against_the_overridden_heads():
  cfg = parse_config(["prog", "--num_heads=8", "--num_kv_heads=8", "--mesh_fsdp=1", "--mesh_tensor=8"])
  validate(cfg, 8)  # 8 heads now divide tensor parallel 8 (tiny's own 4 do not)
  with pytest.raises(ConfigError, match="mesh_tensor=8"):
    validate(parse_config(["prog", "--num_heads=2", "--num_kv_heads=2", "--mesh_fsdp=1", "--mesh_tensor=8"]), 8)


def test_a_resume_refuses_another_shape_and_accepts_a_run_written_before_the_shape_flags():
  import json

  from mimo_jax.train.rundir import identity_mismatches

  cfg = parse_config(["prog", "--model_preset=tiny"])
  old = json.loads(cfg.to_json())
  for name in ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
    del old["model"][name]
  assert identity_mismatches(old, cfg.to_dict()) == []
  wider = parse_config(["prog", "--model_preset=tiny", "--d_model=128"]).to_dict()
  assert identity_mismatches(old, wider) == ["--d_model: 0 -> 128"]


def test_main_builds_the_shape_the_flags_name(capsys):
  path = os.path.join(ROOT, "experiments", "smoke_tiny.flags")
  assert main(["prog", f"--flagfile={path}", "--d_model=32", "--num_layers=1"]) == 0
  # 1 layer at d 32 (head 8, kv width 16, MLP 128) plus embedding and unembedding 2*256*32 and the final norm.
  assert "params: 31840" in capsys.readouterr().out


def test_the_settings_added_later_are_real_fields_whose_defaults_keep_the_old_behaviour():
  from mimo_jax.config import ADDED_SETTINGS, SHAPE_FLAGS

  for concern, names in ADDED_SETTINGS.items():
    fields = {f.name: f for f in dataclasses.fields(CONCERN_CLASSES[concern])}
    assert set(names) <= set(fields), concern
  defaults = Config()
  # The defaults that keep an older run's behaviour: the preset's shape, no best copy, alarms that only log.
  assert all(getattr(defaults.model, n) == 0 for n in SHAPE_FLAGS)
  assert defaults.checkpoint.keep_best == "" and defaults.logging.on_alarm == "log"


@pytest.mark.parametrize("size", ["7b", "13b"])
def test_the_per_size_presets_follow_the_size_rules_from_the_1b_preset(size):
  """Bigger models: learning rate down, initial KL down, entropy bonus up, clip with the LR (the reports)."""
  from mimo_jax.sweep.coupling import couple

  def flags(name, *extra):
    return parse_config(["prog", f"--flagfile={os.path.join(ROOT, 'experiments', name)}", *extra])

  base, preset = flags("grpo_1b.flags"), flags(f"grpo_{size}.flags")
  # The 1B preset moved to this size (shape and vocabulary only), then coupled by the rules.
  point = flags("grpo_1b.flags", f"--model_preset={size}", f"--vocab_size={preset.model.vocab_size}")
  coupled, changes = couple(base, point)
  assert {c.flag for c in changes} == {"learning_rate", "kl_coef", "entropy_coef", "grad_clip"}
  assert coupled.optim.learning_rate == preset.optim.learning_rate < base.optim.learning_rate
  assert coupled.algo.kl_coef == preset.algo.kl_coef < base.algo.kl_coef
  assert coupled.algo.entropy_coef == preset.algo.entropy_coef > base.algo.entropy_coef > 0
  assert coupled.optim.grad_clip == preset.optim.grad_clip < base.optim.grad_clip
