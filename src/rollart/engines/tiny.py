"""A tiny Qwen3-style causal LM and tokenizer, built locally for tests and CPU runs.

`build_tiny_model(out_dir)` writes a directory that loads offline with
`AutoTokenizer.from_pretrained(out_dir)` and `AutoModelForCausalLM.from_pretrained(out_dir)`:

- model: `Qwen3ForCausalLM` from a `Qwen3Config`, random init under `seed`, float32,
  untied input/output embeddings (so a plain `save_file(model.state_dict())` works);
- tokenizer: byte-level BPE trained in memory with `tokenizers` on a built-in corpus
  (FrozenLake/Sokoban grids, the actions L D R U, digits, arithmetic, instruction words,
  `<answer></answer>` tags) plus the caller's `corpus`. Special tokens:
  `<|endoftext|>` (id 0, pad), `<|im_start|>` (id 1), `<|im_end|>` (id 2, eos, ends a chat
  turn). A ChatML `chat_template` is stored with the tokenizer.

The tokenizer is saved with `tokenizer_class = "TokenizersBackend"` so that transformers 5
does not map the `qwen3` model type to `Qwen2Tokenizer` (which adds its own tokens and
overflows a small vocabulary). Pre-tokenization keeps letters, single digits and punctuation
apart (GPT-2 style, digits split one by one), so "L", "D", "R", "U" and " L", " D", " R",
" U" are each exactly one token; the build checks this.

Building is idempotent: `rollart_tiny.json` in `out_dir` records the arguments (and a hash of
`corpus`); a directory with a matching record is returned as is.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

__all__ = ["build_tiny_model", "ACTION_LETTERS", "CHAT_TEMPLATE", "SPECIAL_TOKENS"]

MANIFEST = "rollart_tiny.json"
FORMAT_VERSION = 2  # 2: the chat template renders tools

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
ACTION_LETTERS = ("L", "D", "R", "U")

# ChatML, as Qwen uses it (without thinking). Tools as Qwen renders them: the schemas in the
# system turn, a call as <tool_call>{"name": ..., "arguments": ...}</tool_call> in the
# assistant's text, a tool's result as a turn of role "tool". Without tools the text is the
# plain ChatML of format 1.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set f = call['function'] if call.get('function') else call %}"
    "{{- '<tool_call>{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# GPT-2 style split, except that digits are split one by one (as Qwen does).
_SPLIT_PATTERN = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)

_WORDS = (
    "You are an agent playing a game . Reply with one action inside answer tags . "
    "You are on a frozen lake . Reach the goal G without falling into a hole H . "
    "S is the start , F is frozen ice , P is your position . "
    "Push every box onto a target . The walls are # and the player is @ . "
    "Actions : L means left , D means down , R means right , U means up . "
    "Think step by step , then give the final answer . "
    "What is the result ? Compute the sum . Answer with a number . "
    "The answer is correct . The answer is wrong . You won . You lost . "
    "Valid actions are L , D , R , U . Your move : Your action : "
    "user assistant system turn step reward done invalid action format please "
    "left right up down move moves goal hole ice box boxes target targets wall player "
    "the a an of to in is on and or if then else not with for from this that it "
    "plus minus times divided equals number numbers first second last next current state "
).split()


def _builtin_corpus(seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    lines: list[str] = []
    # FrozenLake grids (4x4 and 8x8) with positions.
    for _ in range(300):
        n = rng.choice((4, 4, 4, 8))
        rows = []
        for r in range(n):
            row = "".join(rng.choice("FFFFH") for _ in range(n))
            rows.append(row)
        rows[0] = "S" + rows[0][1:]
        rows[-1] = rows[-1][:-1] + "G"
        if rng.random() < 0.5:
            r, c = rng.randrange(n), rng.randrange(n)
            rows[r] = rows[r][:c] + "P" + rows[r][c + 1 :]
        lines.append("\n".join(rows))
    # Sokoban grids.
    for _ in range(150):
        h, w = rng.randint(5, 7), rng.randint(5, 7)
        grid = [["#"] * w for _ in range(h)]
        for r in range(1, h - 1):
            for c in range(1, w - 1):
                grid[r][c] = rng.choice("____#")
        for ch in "@$X$X":
            r, c = rng.randint(1, h - 2), rng.randint(1, w - 2)
            grid[r][c] = ch
        lines.append("\n".join("".join(row) for row in grid))
    # Actions: alone, spaced, in answer tags, in sentences.
    for _ in range(400):
        a = rng.choice(ACTION_LETTERS)
        seq = " ".join(rng.choice(ACTION_LETTERS) for _ in range(rng.randint(1, 8)))
        lines.append(f"<answer>{a}</answer>")
        lines.append(f"Action : {a} . Moves : {seq}")
        lines.append(f"I move {a} , then {rng.choice(ACTION_LETTERS)} .")
    # Arithmetic.
    for _ in range(400):
        x, y = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        val = x + y if op == "+" else x - y if op == "-" else x * y
        lines.append(f"What is {x} {op} {y} ? {x} {op} {y} = {val} <answer>{val}</answer>")
    # Instruction text.
    for _ in range(300):
        k = rng.randint(6, 20)
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(k)))
    lines.append(" ".join(_WORDS))
    # Chat formatting.
    for role in ("system", "user", "assistant"):
        for _ in range(20):
            lines.append(f"{IM_START}{role}\n{rng.choice(_WORDS)} {rng.choice(_WORDS)}{IM_END}\n")
    return lines


def _args_record(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    seed: int,
    corpus: list[str] | None,
) -> dict:
    corpus_hash = None
    if corpus:
        h = hashlib.sha256()
        for line in corpus:
            h.update(line.encode("utf-8"))
            h.update(b"\0")
        corpus_hash = h.hexdigest()
    return {
        "format": FORMAT_VERSION,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
        "corpus_sha256": corpus_hash,
    }


def _train_tokenizer(vocab_size: int, corpus: list[str]):
    # optional dependency
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    return tok


def _check_tokenizer(tokenizer, vocab_size: int) -> None:
    n = len(tokenizer)
    if n > vocab_size:
        raise RuntimeError(
            f"tokenizer ({type(tokenizer).__name__}) has {n} tokens, more than the model's "
            f"vocab_size {vocab_size}"
        )
    for a in ACTION_LETTERS:
        for text in (a, " " + a):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) != 1:
                raise RuntimeError(f"{text!r} is not a single token: {ids}")
    for t in SPECIAL_TOKENS:
        ids = tokenizer.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise RuntimeError(f"special token {t!r} is not a single token: {ids}")


def _manifest_matches(out_dir: Path, record: dict) -> bool:
    try:
        return json.loads((out_dir / MANIFEST).read_text()) == record
    except (OSError, ValueError):
        return False


def build_tiny_model(
    out_dir: str | os.PathLike,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    corpus: list[str] | None = None,
) -> Path:
    """Build (or reuse) a tiny Qwen3 model + tokenizer in `out_dir`; return `out_dir`.

    Deterministic for given arguments. If `out_dir` already holds a build with the same
    arguments (recorded in `rollart_tiny.json`, written last), nothing is rebuilt. Files are
    built in a temporary sibling directory and moved in, so a concurrent reader never sees a
    half-written model with a matching record.
    """
    out_dir = Path(out_dir)
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 8:
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS) + 8}")
    record = _args_record(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        corpus=corpus,
    )
    if _manifest_matches(out_dir, record):
        return out_dir

    import torch  # optional dependency
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, TokenizersBackend

    texts = _builtin_corpus() + list(corpus or [])
    raw = _train_tokenizer(vocab_size, texts)
    pad_id, im_start_id, im_end_id = (raw.token_to_id(t) for t in SPECIAL_TOKENS)
    tokenizer = TokenizersBackend(
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=max_position_embeddings,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    _check_tokenizer(tokenizer, vocab_size)

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_layers,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        bos_token_id=None,
        eos_token_id=im_end_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end_id, pad_id], pad_token_id=pad_id, bos_token_id=None
    )
    model.eval()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # Force the generic fast tokenizer class on reload (see module docstring).
        tc_path = tmp / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text())
        tc["tokenizer_class"] = "TokenizersBackend"
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / MANIFEST).unlink(missing_ok=True)
        for f in sorted(tmp.iterdir()):
            os.replace(f, out_dir / f.name)
        tmp_manifest = out_dir / f".{MANIFEST}.tmp{os.getpid()}"
        tmp_manifest.write_text(json.dumps(record, indent=2, sort_keys=True))
        os.replace(tmp_manifest, out_dir / MANIFEST)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
