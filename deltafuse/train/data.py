"""Training data: JSONL loading with strict row checks, tokenisation with completion-only labels.

Rows are ``{"prompt": str, "completion": str}`` or ``{"messages": [{"role": str, "content": str}, ...]}``.
Loss is computed only on the completion / the assistant turns. With a chat template in the tokenizer both
kinds of row are rendered through it (a prompt/completion row becomes one user and one assistant turn);
without one, prompt and completion are joined as plain text and messages as ``role: content`` lines.

The examples are packed into bins and collated into batches by ``deltafuse.train.packing``.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass, field

from deltafuse.train.errors import TrainInputError

IGNORE_INDEX = -100


@dataclass
class DataStats:
    source: str = ""
    rows_read: int = 0
    bad_rows_skipped: int = 0
    bad_row_lines: list = field(default_factory=list)  # the first few line numbers skipped
    truncated: int = 0
    dropped_no_completion: int = 0
    examples: int = 0
    tokens: int = 0
    completion_tokens: int = 0

    def summary_lines(self, seq_len: int) -> list[str]:
        lines = [f"data: {self.source}: {self.rows_read} rows read, {self.examples} examples, "
                 f"{self.tokens} tokens ({self.completion_tokens} trained on)"]
        if self.bad_rows_skipped:
            shown = ", ".join(map(str, self.bad_row_lines))
            more = ", ..." if self.bad_rows_skipped > len(self.bad_row_lines) else ""
            lines.append(f"data: skipped {self.bad_rows_skipped} bad row(s) (--skip-bad-rows), lines {shown}{more}")
        if self.truncated:
            lines.append(f"data: truncated {self.truncated} row(s) longer than --seq-len {seq_len} tokens")
        if self.dropped_no_completion:
            lines.append(f"data: dropped {self.dropped_no_completion} row(s) with no completion token within "
                         f"--seq-len {seq_len}")
        return lines


# --- JSONL -------------------------------------------------------------------------------------------
def _row_problem(row) -> str | None:
    """Why a parsed JSON value is not a usable row, or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty list of {\"role\", \"content\"} objects"
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return f"messages[{i}] must be an object with string 'role' and 'content'"
        if not any(m["role"] == "assistant" for m in msgs):
            return "'messages' has no assistant turn (the loss is computed on assistant turns only)"
        if all(m["content"] == "" for m in msgs if m["role"] == "assistant"):
            return "every assistant turn in 'messages' is empty"
        return None
    if "prompt" in row or "completion" in row:
        for key in ("prompt", "completion"):
            if not isinstance(row.get(key), str):
                return f"'{key}' must be a string, got {type(row.get(key)).__name__}"
        if row["completion"] == "":
            return "'completion' is empty (the loss is computed on the completion only)"
        return None
    keys = ", ".join(sorted(map(str, row))) or "none"
    return f"a row needs 'prompt' and 'completion', or 'messages'; it has keys: {keys}"


def check_file(path: str, flag: str = "--data") -> None:
    """The path names a file (not missing, not a directory); its rows are checked as they are read."""
    if not os.path.exists(path):
        raise TrainInputError(f"{flag} {path!r}: no such file")
    if os.path.isdir(path):
        raise TrainInputError(f"{flag} {path!r} is a directory; expected a JSONL file")


def iter_jsonl(path: str, *, skip_bad_rows: bool = False, stats: DataStats | None = None, flag: str = "--data",
               progress: bool = False):
    """The rows of a JSONL file, one at a time (the file is streamed, never read whole); a bad line raises
    TrainInputError naming it (as ``flag``), unless ``skip_bad_rows``. ``progress``: a bar of the bytes read
    on stderr."""
    stats = stats if stats is not None else DataStats()
    stats.source = path
    check_file(path, flag)
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise TrainInputError(f"{flag} {path!r} cannot be read: {exc.strerror or exc}") from None
    bar = None
    kept = 0
    with fh:
        if progress:
            import sys

            from tqdm.auto import tqdm

            bar = tqdm(total=os.fstat(fh.fileno()).st_size, desc=f"reading {os.path.basename(path)}", unit="B",
                       unit_scale=True, dynamic_ncols=True, file=sys.stderr, leave=False)
        try:
            for lineno, line in enumerate(_lines(fh, path, flag), start=1):
                if bar is not None:
                    bar.update(len(line))
                if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is not content
                    line = line[3:]
                if not line.strip():
                    continue
                stats.rows_read += 1
                try:
                    row = json.loads(line.decode("utf-8"))
                    problem = _row_problem(row)
                except UnicodeDecodeError as exc:
                    problem = f"not valid UTF-8 ({exc.reason} at byte {exc.start})"
                except json.JSONDecodeError as exc:
                    problem = f"not valid JSON ({exc.msg} at column {exc.colno})"
                if problem is not None:
                    if not skip_bad_rows:
                        raise TrainInputError(f"{flag} {path!r} line {lineno}: {problem}; fix the line or pass "
                                              "--skip-bad-rows to skip bad rows (they are counted)")
                    stats.bad_rows_skipped += 1
                    if len(stats.bad_row_lines) < 10:
                        stats.bad_row_lines.append(lineno)
                    continue
                kept += 1
                yield row
        finally:
            if bar is not None:
                bar.close()
    if not kept:
        if stats.rows_read == 0:
            raise TrainInputError(f"{flag} {path!r} is empty: no JSONL rows")
        raise TrainInputError(f"{flag} {path!r}: all {stats.rows_read} rows are bad (skipped with "
                              "--skip-bad-rows); nothing to train on")


def _lines(fh, path: str, flag: str):
    """The lines of a binary file without their b"\\n" (as ``bytes.split`` gives them), read as they come."""
    while True:
        try:
            line = fh.readline()
        except OSError as exc:
            raise TrainInputError(f"{flag} {path!r} cannot be read: {exc.strerror or exc}") from None
        if not line:
            return
        yield line[:-1] if line.endswith(b"\n") else line


def load_jsonl(path: str, *, skip_bad_rows: bool = False, stats: DataStats | None = None,
               flag: str = "--data") -> list[dict]:
    """The rows of a JSONL file as a list (``iter_jsonl``)."""
    return list(iter_jsonl(path, skip_bad_rows=skip_bad_rows, stats=stats, flag=flag))


# --- tokenisation ------------------------------------------------------------------------------------
def _as_messages(row: dict) -> list[dict]:
    if "messages" in row:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]


def _assistant_spans_incremental(tokenizer, msgs: list[dict], text: str) -> list[tuple[int, int]] | None:
    """Assistant spans from renderings of growing prefixes; None when the template is not prefix-stable."""
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
        if not text.startswith(upto) or not upto.startswith(before):
            return None
        spans.append((len(before), len(upto)))
    return spans


def _assistant_spans_by_content(tokenizer, msgs: list[dict], text: str) -> list[tuple[int, int]]:
    """Assistant spans found by their content, in order, with the end-of-turn token that follows it.

    For templates that render a turn differently once later turns follow (e.g. reasoning blocks kept only
    on the last turn), where growing prefixes are not prefixes of the whole conversation.
    """
    ends = [t for t in (tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<|end|>") if t]
    spans, pos = [], 0
    for m in msgs:
        if m["role"] == "assistant":
            start = text.find(m["content"], pos)
            if start < 0:
                raise TrainInputError("the tokenizer's chat template does not reproduce an assistant turn's "
                                      "content verbatim, so the loss mask cannot be placed; use "
                                      '{"prompt","completion"} rows or a tokenizer whose template keeps it')
            end = start + len(m["content"])
            for marker in ends:
                if text.startswith(marker, end):
                    end += len(marker)
                    break
            spans.append((start, end))
            pos = end
        elif m["content"]:
            found = text.find(m["content"], pos)
            pos = found + len(m["content"]) if found >= 0 else pos
    return spans


def _render(tokenizer, row: dict) -> tuple[str, list[tuple[int, int]], bool]:
    """(text, character spans to train on, add_special_tokens)."""
    if getattr(tokenizer, "chat_template", None):
        msgs = _as_messages(row)
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        spans = _assistant_spans_incremental(tokenizer, msgs, text)
        if spans is None:
            spans = _assistant_spans_by_content(tokenizer, msgs, text)
        return text, spans, False
    eos = tokenizer.eos_token or ""
    if "messages" in row:
        text, spans = "", []
        for m in row["messages"]:
            head = f"{m['role']}: "
            body = m["content"] + ("\n" if m["role"] != "assistant" else eos + "\n")
            if m["role"] == "assistant":
                spans.append((len(text) + len(head), len(text) + len(head) + len(body)))
            text += head + body
        return text, spans, True
    text = row["prompt"] + row["completion"] + eos
    return text, [(len(row["prompt"]), len(text))], True


# A cut text is tokenised as the whole text would be up to the last tokens before the cut: a token is kept
# only if it ends at least this many characters before the cut (tokenizers merge within words and whitespace
# runs, never across kilobytes).
CUT_MARGIN_CHARS = 1024


# Rows are rendered and tokenised in batches: one call of the tokenizer per batch (a fast tokenizer encodes a
# batch on several threads), each batch at most this many rows, or fewer once their rendered texts hold this many
# characters (a streamed file of long rows is still held a batch at a time, never whole).
ENCODE_BATCH_ROWS = 256
ENCODE_BATCH_CHARS = 8 << 20


def _encode_prefixes(tokenizer, texts: list[str], seq_len: int, add_special: bool) -> list[tuple]:
    """(input_ids, offsets, truncated) of the first ``seq_len`` tokens of each text.

    Only a prefix of a text is tokenised, grown until it yields more than ``seq_len`` tokens that end
    ``CUT_MARGIN_CHARS`` before the cut (or until it is the whole text): the work and memory are bounded by the
    tokens kept, not by the row (a 50 MB line costs what its first ``seq_len`` tokens cost). Every round encodes
    the texts still growing in one batch.
    """
    out: list = [None] * len(texts)
    todo = list(range(len(texts)))
    cut = 4 * seq_len + 2 * CUT_MARGIN_CHARS
    while todo:
        whole = [cut >= len(texts[i]) for i in todo]
        enc = tokenizer([texts[i] if w else texts[i][:cut] for i, w in zip(todo, whole)],
                        add_special_tokens=add_special, return_offsets_mapping=True)
        growing = []
        for i, w, ids, offsets in zip(todo, whole, enc["input_ids"], enc["offset_mapping"]):
            if w:
                out[i] = (ids[:seq_len], offsets[:seq_len], len(ids) > seq_len)
                continue
            limit, stable = cut - CUT_MARGIN_CHARS, 0
            for _, end in offsets:  # the leading tokens that the cut cannot have changed
                if end > limit:
                    break
                stable += 1
            if stable > seq_len:
                out[i] = (ids[:seq_len], offsets[:seq_len], True)
            else:
                growing.append(i)
        todo = growing
        cut *= 2
    return out


def _encode_rendered(tokenizer, rendered: list[tuple], seq_len: int) -> list[tuple[list[int], list[int], bool]]:
    """``encode_row`` of rows already rendered (``_render``): one batch per add_special_tokens value."""
    out: list = [None] * len(rendered)
    for add_special in {r[2] for r in rendered}:
        idx = [i for i, r in enumerate(rendered) if r[2] == add_special]
        encoded = _encode_prefixes(tokenizer, [rendered[i][0] for i in idx], seq_len, add_special)
        for i, (ids, offsets, truncated) in zip(idx, encoded):
            spans = _union(rendered[i][1])
            starts = [a for a, _ in spans]
            labels = []
            for tok, (start, end) in zip(ids, offsets):  # a token is trained on if it starts inside a span
                k = bisect.bisect_right(starts, start) - 1
                labels.append(tok if end > start and k >= 0 and start < spans[k][1] else IGNORE_INDEX)
            out[i] = (ids, labels, truncated)
    return out


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The character spans [a, b) as sorted disjoint spans covering the same characters."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def encode_row(tokenizer, row: dict, seq_len: int) -> tuple[list[int], list[int], bool]:
    """(input_ids, labels with IGNORE_INDEX outside the completion, truncated?); only the tokens that
    ``seq_len`` keeps are computed."""
    return _encode_rendered(tokenizer, [_render(tokenizer, row)], seq_len)[0]


def encode_rows(tokenizer, rows, seq_len: int, stats: DataStats, vocab_size: int | None = None):
    """Encoded examples ``{"input_ids", "labels"}`` of an iterable of rows (consumed a batch at a time: a streamed
    file is never held whole); counts truncated and dropped rows in ``stats``."""
    examples: list[dict] = []

    def add(batch: list[tuple]) -> None:
        for ids, labels, truncated in _encode_rendered(tokenizer, batch, seq_len):
            stats.truncated += int(truncated)
            n_completion = sum(1 for x in labels[1:] if x != IGNORE_INDEX)  # the first label is never predicted
            if n_completion == 0:
                stats.dropped_no_completion += 1
                continue
            if vocab_size is not None:
                check_vocabulary([{"input_ids": ids}], vocab_size)
            examples.append({"input_ids": ids, "labels": labels})
            stats.tokens += len(ids)
            stats.completion_tokens += n_completion

    batch, chars = [], 0
    for row in rows:
        batch.append(_render(tokenizer, row))
        del row
        chars += len(batch[-1][0])
        if len(batch) >= ENCODE_BATCH_ROWS or chars >= ENCODE_BATCH_CHARS:
            add(batch)
            batch, chars = [], 0
    if batch:
        add(batch)
    del batch
    stats.examples = len(examples)
    if not examples:
        raise TrainInputError(f"no row keeps a completion token within --seq-len {seq_len} "
                              f"({stats.dropped_no_completion} row(s) dropped); raise --seq-len")
    return examples


def check_vocabulary(examples: list[dict], vocab_size: int) -> None:
    """Every token id fits the model's vocabulary (else the tokenizer is not the model's)."""
    top = max((max(ex["input_ids"]) for ex in examples if ex["input_ids"]), default=-1)
    if top >= vocab_size:
        raise TrainInputError(f"the tokenizer produces id {top} but the model's vocabulary has only "
                              f"{vocab_size} entries; use the tokenizer that belongs to the model")
