"""The reliability campaign's ledger: what a writer reported, one line per event, written
(unbuffered) right after the call returned ("acknowledged") or right before it started
("attempted", where that widens what may legitimately be found afterwards):

    E <id>          epoch <id> is durable (write_epoch / sync returned)
    R <t>           retain(KEEP) is about to run: unnamed epochs <= t may go
    F <id> <seq>    fact <id> (text/KV of sequence number seq, KV variant 1) is durable
    k <id> <w>      set_fact_kv(<id>) to KV variant w is about to run;   K <id> <w>: it returned
    f <id>          forget_fact(<id>) is about to run;                    G <id>: it returned
    @ <op>          the writer starts <op> (where a kill landed: the last "@" before the end)
    P <step> <hex>  (Session writers) the state digest of step <step> about to be checkpointed
    A <epoch>       (Session writers) epoch is durable (checkpoint(wait=True) / flush returned)
    W <mark> <s>    when the writer's Store.open started / ended (aims later kills; not a fact)

The oracles that use it are in reliability_oracle.py; the content it refers to in
reliability_harness.py. Torch-free (the SIGKILL children import it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .reliability_harness import epoch_name


@dataclass
class Ledger:
    """What writers acknowledged (and attempted) on one store, over any number of writer lives."""
    acked: set[int] = field(default_factory=set)
    droppable: int = 0                                    # unnamed epochs <= this may be retained away
    facts: dict[int, int] = field(default_factory=dict)   # acked fact id -> seq
    kv_acked: dict[int, int] = field(default_factory=dict)
    kv_tried: dict[int, int] = field(default_factory=dict)
    forget_tried: set[int] = field(default_factory=set)
    forgotten: set[int] = field(default_factory=set)
    digests: dict[int, set[str]] = field(default_factory=dict)   # Session writers: step -> digests
    last_op: str = ""
    lines: int = 0

    def feed(self, text: str) -> None:
        for line in text.splitlines():
            self.line(line)

    def line(self, line: str) -> None:
        parts = line.split()
        if not parts:
            return
        self.lines += 1
        tag, args = parts[0], parts[1:]
        try:
            nums = [int(a) for a in args] if tag != "@" and tag != "P" else []
        except ValueError:
            return  # a torn last line (the writer died mid-write): never acknowledged
        if tag in ("E", "A") and nums:
            self.acked.add(nums[0])
        elif tag == "R" and nums:
            self.droppable = max(self.droppable, nums[0])
        elif tag == "F" and len(nums) == 2:
            self.facts[nums[0]] = nums[1]
        elif tag == "k" and len(nums) == 2:
            self.kv_tried[nums[0]] = max(self.kv_tried.get(nums[0], 1), nums[1])
        elif tag == "K" and len(nums) == 2:
            self.kv_acked[nums[0]] = nums[1]
        elif tag == "f" and nums:
            self.forget_tried.add(nums[0])
        elif tag == "G" and nums:
            self.forgotten.add(nums[0])
        elif tag == "P" and len(args) == 2 and args[0].isdigit():
            self.digests.setdefault(int(args[0]), set()).add(args[1])
        if tag == "@":
            self.last_op = " ".join(args)
        elif tag in "EAFKG":
            self.last_op = f"idle (after {tag})"

    @property
    def newest(self) -> int:
        return max(self.acked, default=0)

    def must_have(self) -> set[int]:
        """Acknowledged epochs that retention would keep."""
        return {e for e in self.acked if epoch_name(e) is not None or e > self.droppable}

    def live_facts(self) -> list[tuple[int, int, int]]:
        """(id, seq, next KV variant) of acknowledged facts that no forget was tried on."""
        return [(fid, seq, self.kv_tried.get(fid, 1) + 1) for fid, seq in sorted(self.facts.items())
                if fid not in self.forget_tried]

    def copy(self) -> "Ledger":
        return Ledger(set(self.acked), self.droppable, dict(self.facts), dict(self.kv_acked),
                      dict(self.kv_tried), set(self.forget_tried), set(self.forgotten),
                      {k: set(v) for k, v in self.digests.items()}, self.last_op, self.lines)


def span(ids: list[int]) -> str:
    return "no epochs" if not ids else f"{len(ids)} epochs {ids[0]}..{ids[-1]}"
