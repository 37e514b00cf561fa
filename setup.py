"""mimo-jax: a JAX-native RL trainer (GRPO, PPO) for large language models."""

from setuptools import find_packages, setup

# Versions checked together (see BUILD_NOTES.md). CPU jax by default; the gpu/tpu
# extras swap in the accelerator builds of the same version.
JAX_VERSION = "0.10.2"
INSTALL_REQUIRES = [
  f"jax=={JAX_VERSION}",
  f"jaxlib=={JAX_VERSION}",
  "flax==0.12.8",
  "optax==0.2.8",
  "orbax-checkpoint==0.12.8",
  "chex==0.1.92",
  "tensorflow-datasets==4.9.10",
  "array-record==0.8.6",
  "importlib_resources",  # an undeclared dependency of tensorflow-datasets 4.9.10
  "sentencepiece==0.2.3",
  "absl-py==2.5.1",
  "safetensors==0.8.0",
  "numpy==2.4.6",
  "tqdm",
  "tensorboardX",
]

EXTRAS = {
  # Hugging Face tokenizer.json support (Llama-3 / Qwen tokenizers) and their chat templates (--chat_template=model).
  "hf": ["tokenizers>=0.22", "jinja2>=3.1"],
  # The run and sweep reports' plots (python -m mimo_jax.report, python -m mimo_jax.sweep).
  "report": ["matplotlib==3.10.9"],
  # Weights & Biases logging (--wandb_project); TensorBoard and the run directory's files stay the default.
  "wandb": ["wandb==0.30.0"],
  "test": [
    "pytest>=8",
    "ruff>=0.6",
    # Oracles for tests and conversion: transformers on torch (the tests run it on the CPU).
    "torch==2.13.0",
    "transformers==5.24.0",
    "tokenizers>=0.22",
    "jinja2>=3.1",  # chat templates (also a dependency of torch; named so those tests never skip)
    # The math reward's symbolic-equivalence tests (also a dependency of torch; named so they never skip).
    "sympy>=1.12",
    # The sweep fit's least-squares oracle (also a dependency of jax; named because a test imports it).
    "scipy>=1.14",
    "matplotlib==3.10.9",
    "selenium==4.50.0",  # drives Debian's chromium for the report's browser test (make browser installs it)
    "wandb==0.30.0",  # the offline W&B test
    "nbclient==0.11.0",  # executes notebooks/quickstart.ipynb
    "nbformat==5.11.1",
    "ipykernel==7.4.0",
  ],
  "gpu": [f"jax[cuda12]=={JAX_VERSION}"],
  "tpu": [f"jax[tpu]=={JAX_VERSION}"],
}

setup(
  name="mimo-jax",
  version="0.1.0",
  description="A JAX-native reinforcement-learning trainer for large language models.",
  python_requires=">=3.11",
  packages=find_packages(include=["mimo_jax", "mimo_jax.*"])
  + ["mimo_jax.kernels", "mimo_jax.checkpoints_schema"]
  + [f"mimo_jax.kernels.{p}" for p in find_packages("kernels")],
  package_dir={"mimo_jax.kernels": "kernels", "mimo_jax.checkpoints_schema": "checkpoints_schema"},
  package_data={
    "mimo_jax": ["data/*", "data/*/*"],
    "mimo_jax.checkpoints_schema": ["*.json"],
    "mimo_jax.kernels.cpu_rows": ["*.cc"],
  },
  install_requires=INSTALL_REQUIRES,
  extras_require=EXTRAS,
)
