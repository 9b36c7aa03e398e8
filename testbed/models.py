"""Random-weight Llama models built locally, for tests and benchmarks without downloads.

A model folder holds a ``LlamaForCausalLM`` (``config.json``, safetensors weights) and a byte-level
BPE tokenizer trained on generated text and saved as a ``PreTrainedTokenizerFast``, so that
``vllm.LLM(model=str(path))`` loads it offline. Building is deterministic: the same spec gives the
same weights, hence the same greedy outputs in every process. Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

MARKER_FILE = "kvshelf-model.json"
"""Written last into a model folder: its presence means the folder is complete."""

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_SYLLABLES = tuple(f"{c}{v}" for c in "kmnrstlvdpgzfhbj" for v in "aeiou")


@dataclass(frozen=True)
class ModelSpec:
    """Shape and seed of a random-weight Llama model.

    Attributes:
        hidden_size: Width of the residual stream.
        num_layers: Number of decoder layers.
        num_heads: Number of query heads.
        num_kv_heads: Number of key/value heads (fewer than ``num_heads`` for grouped-query).
        head_dim: Size of one attention head; vLLM's CPU backend accepts 32, 64, 80, 96, 112,
            128, 160, 192, 224, 256 and 512.
        vocab_size: Size of both the tokenizer's and the model's vocabulary.
        max_position: ``max_position_embeddings`` of the model.
        dtype: Weight dtype name (``"float32"``, ``"bfloat16"`` or ``"float16"``).
        seed: Seed of the weights and of the tokenizer's training text.
        init_std: Standard deviation of the random weights. Larger than the usual 0.02 so that
            attention matters: the next token then depends on the whole context, which makes
            "same greedy output" a real check of the KV cache, and logits are well separated,
            so that greedy decoding does not flip on rounding differences.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 2048
    max_position: int = 4096
    dtype: str = "float32"
    seed: int = 0
    init_std: float = 0.3

    @property
    def intermediate_size(self) -> int:
        """Width of the MLP: about 8/3 of the hidden size, rounded up to a multiple of 64."""
        return -(-self.hidden_size * 8 // 3 // 64) * 64

    def dir_name(self) -> str:
        """Return a folder name that identifies this spec.

        Returns:
            A name such as ``llama-h128-l2-q2kv2-d64-v2048-p4096-float32-std0.3-s0``.
        """
        return (
            f"llama-h{self.hidden_size}-l{self.num_layers}-q{self.num_heads}kv{self.num_kv_heads}"
            f"-d{self.head_dim}-v{self.vocab_size}-p{self.max_position}-{self.dtype}"
            f"-std{self.init_std:g}-s{self.seed}"
        )


TINY = ModelSpec()
"""Two layers of width 128: loads and runs in seconds; for correctness tests."""

PERF = ModelSpec(
    hidden_size=1024,
    num_layers=16,
    num_heads=8,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=4096,
    max_position=8192,
    init_std=0.05,
)
"""About 200 M parameters: prefill of a long prompt costs far more than loading its KV."""

PERF_GQA = replace(PERF, num_kv_heads=2)
"""``PERF`` with grouped-query attention (4 query heads per KV head): a quarter of the KV bytes."""


def default_model_cache_dir() -> Path:
    """Return the folder that holds built models.

    Returns:
        ``$KVSHELF_MODEL_CACHE`` if set; else ``<repo>/.cache/models`` when the test bed runs
        from a source checkout (a ``pyproject.toml`` beside this package); else
        ``~/.cache/kvshelf/models``.
    """
    env = os.environ.get("KVSHELF_MODEL_CACHE")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[1]
    if (repo / "pyproject.toml").is_file() and (repo / "src" / "kvshelf").is_dir():
        return repo / ".cache" / "models"
    return Path.home() / ".cache" / "kvshelf" / "models"


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    hidden_size: int = TINY.hidden_size,
    num_layers: int = TINY.num_layers,
    num_heads: int = TINY.num_heads,
    num_kv_heads: int = TINY.num_kv_heads,
    head_dim: int = TINY.head_dim,
    vocab_size: int = TINY.vocab_size,
    max_position: int = TINY.max_position,
    dtype: str = TINY.dtype,
    seed: int = TINY.seed,
    init_std: float = TINY.init_std,
) -> Path:
    """Write a random-weight Llama model and its tokenizer to ``path``, once.

    See `ModelSpec` for the meaning of the keyword arguments.

    Args:
        path: Folder to create. If it already holds a complete model of the same spec, nothing
            is written.

    Returns:
        ``path`` as a `Path`.

    Raises:
        FileExistsError: ``path`` exists but is not a model of this spec.
    """
    spec = ModelSpec(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position=max_position,
        dtype=dtype,
        seed=seed,
        init_std=init_std,
    )
    return build_model(spec, path)


def build_model(spec: ModelSpec, path: str | os.PathLike[str] | None = None) -> Path:
    """Write the model of ``spec`` to ``path``, once; safe to call from concurrent processes.

    Builders serialize on a lock file beside ``path``; each writes into a temporary folder in
    the same parent and renames it into place, so ``path`` is either absent or complete.

    Args:
        spec: The model to build.
        path: Target folder; default ``default_model_cache_dir() / spec.dir_name()``.

    Returns:
        The model folder.

    Raises:
        FileExistsError: ``path`` exists but is not a model of this spec.
    """
    target = Path(path) if path is not None else default_model_cache_dir() / spec.dir_name()
    if _is_complete(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target, spec):
            return target
        if target.exists():
            raise FileExistsError(f"{target} exists and is not a kvshelf model of {spec}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _write_model(spec, tmp)
            tmp.chmod(0o755)
            for file in tmp.iterdir():
                file.chmod(0o644)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(path: Path, spec: ModelSpec) -> bool:
    """Tell whether ``path`` holds a finished build of ``spec``.

    Args:
        path: Candidate model folder.
        spec: Expected spec.

    Returns:
        True if the marker file exists and records ``spec``.
    """
    try:
        recorded = json.loads((path / MARKER_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return False
    return bool(recorded == asdict(spec))


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` for the duration of the block.

    Args:
        lock_path: Lock file, created if missing.

    Yields:
        Nothing; the lock is held inside the block.
    """
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_model(spec: ModelSpec, folder: Path) -> None:
    """Write the tokenizer, config, weights and finally the marker file into ``folder``.

    Args:
        spec: The model to build.
        folder: An existing, empty folder.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer(spec)
    tokenizer.save_pretrained(folder)
    # transformers 5 records its own class name, which transformers 4 cannot load.
    tokenizer_config = folder / "tokenizer_config.json"
    fields = json.loads(tokenizer_config.read_text())
    fields["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.write_text(json.dumps(fields, indent=2) + "\n")
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position,
        initializer_range=spec.init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype=spec.dtype,
    )
    config.architectures = ["LlamaForCausalLM"]
    generator = torch.Generator().manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * spec.init_std)
    model.to(getattr(torch, spec.dtype)).save_pretrained(folder)
    (folder / MARKER_FILE).write_text(json.dumps(asdict(spec), indent=2) + "\n")


def _train_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer of exactly ``spec.vocab_size`` tokens.

    Args:
        spec: Gives the vocabulary size and the seed of the training text.

    Returns:
        A ``PreTrainedTokenizerFast`` with bos, eos and pad tokens, a post-processor that puts
        bos in front of every encoded text, and a chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(spec.seed), trainer=trainer)
    missing = spec.vocab_size - tokenizer.get_vocab_size()
    if missing < 0:
        raise ValueError(f"vocab_size {spec.vocab_size} is below the byte alphabet's 259")
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position,
    )


def _training_text(seed: int, num_lines: int = 4000) -> Iterator[str]:
    """Generate deterministic pseudo-language text: Zipf-distributed made-up words.

    Args:
        seed: Seed of the word list and of the sentences.
        num_lines: Number of lines to yield.

    Yields:
        Lines of about 40 words with punctuation and digits.
    """
    rng = random.Random(seed)
    words = sorted({"".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(6000)})
    rng.shuffle(words)
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    for _ in range(num_lines):
        sentence = rng.choices(words, weights=weights, k=rng.randint(20, 60))
        if rng.random() < 0.3:
            sentence.append(str(rng.randint(0, 99999)))
        yield " ".join(sentence).capitalize() + rng.choice([".", "!", "?", ",", ";"])


def start_variant(folder: Path) -> tuple[Path, dict[str, int]]:
    """Begin building a model at ``folder`` that shares the tiny Llama's tokenizer.

    Returns:
        A fresh ``<folder>.partial`` holding the tokenizer's files, and the Llama's special
        token ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) for the new config.
    """
    base = build_model(TINY)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in base.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, tmp / file.name)
    llama = json.loads((base / "config.json").read_text())
    return tmp, {name: llama[name] for name in ("bos_token_id", "eos_token_id", "pad_token_id")}


def finish_variant(model: Any, dtype: Any, tmp: Path, folder: Path, marker: dict[str, Any]) -> Path:
    """Save ``model`` in ``dtype`` and its ``marker`` into ``tmp`` (from `start_variant`) and
    rename it into place as ``folder``, which is then either absent or complete."""
    model.to(dtype).save_pretrained(tmp)
    (tmp / MARKER_FILE).write_text(json.dumps(marker) + "\n")
    tmp.rename(folder)
    return folder
