"""The capacity benchmark's trial records: one JSON file, merged from earlier runs' files, written
again after every trial so a run cut short keeps what it measured. The file holds the searches'
trials under "trials" and the repeated step-time comparison's runs under "step_rounds" (each with
its round; files without that list have none). Records set aside by hand (a build's trials measured
again with a later one) go under "superseded" ({"note": ..., "trials": [...], "step_rounds":
[...]}): the searches do not read them, and every save keeps them."""

from __future__ import annotations

import json
import os
from typing import Iterable

ALLOCATOR_ORDER = ("torch", "torch-expandable", "vramledger")


def key(workload: str, allocator: str, cap_gib: float, dim: str, size: int) -> str:
    return f"{workload}|{allocator}|{cap_gib:g}|{dim}|{size}"


def round_key(workload: str, allocator: str, cap_gib: float, dim: str, size: int,
              round_: int) -> str:
    return f"{key(workload, allocator, cap_gib, dim, size)}|round {round_}"


class Results:
    """Trial records by key (workload, allocator, cap, dimension, size), and step-round runs by
    the same key and their round. A trial read again from a later file replaces the earlier one;
    a step round never does (see load)."""

    def __init__(self, path: str | None = None):
        self.path = path
        self.records: dict[str, dict] = {}
        self.rounds: dict[str, dict] = {}
        self.round_files: dict[str, str] = {}  # a round's key -> the file load() last read it from
        self.superseded: dict = {}

    def load(self, paths: Iterable[str]) -> int:
        """Merges the records of earlier runs' files; returns how many search trials it read
        (their step-round runs go to `rounds`). A missing file is an error (a resume that
        silently starts over would spend the GPU time twice), and so is a step round that two
        files, or one file twice, hold with different figures: two runs numbered alike, of
        which one would be dropped from the pooled rounds without a word (a resumed file's copy
        of a round is the same record, and reads as one)."""
        n = 0
        for p in paths:
            with open(p, encoding="utf-8") as f:
                try:
                    doc = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}: not JSON ({e})") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("trials"), list):
                raise ValueError(f"{p}: not a capacity results file (no \"trials\" list)")
            if not isinstance(doc.get("step_rounds", []), list):
                raise ValueError(f"{p}: \"step_rounds\" is not a list")
            aside = doc.get("superseded", {})
            if not isinstance(aside, dict) or not all(
                    isinstance(aside.get(f, []), list) for f in ("trials", "step_rounds")):
                raise ValueError(f"{p}: \"superseded\" is not an object with \"trials\" and "
                                 "\"step_rounds\" lists")
            records = doc["trials"] + doc.get("step_rounds", [])
            if not all(isinstance(r, dict) for r in records):
                raise ValueError(f"{p}: a record that is not an object")
            try:
                for r in doc["trials"]:
                    self.records[key(r["workload"], r["allocator"], r["cap_gib"], r["dim"],
                                     r["size"])] = r
                    n += 1
                for r in doc.get("step_rounds", []):
                    k = round_key(r["workload"], r["allocator"], r["cap_gib"], r["dim"],
                                  r["size"], r["round"])
                    if k in self.rounds and self.rounds[k] != r:
                        run = (f"step round {r['round']} of {r['workload']} {r['allocator']} at "
                               f"{r['cap_gib']:g} GiB, {r['dim']} {r['size']}")
                        if self.round_files.get(k) == p:
                            raise ValueError(f"{p}: {run} is in the file twice, with other "
                                             f"figures: one would be dropped")
                        raise ValueError(
                            f"{p}: {run}, is also in {self.round_files.get(k, 'an earlier file')} "
                            f"with other figures: two runs share the round's number, and one "
                            f"would be dropped (conf_rounds join --pooled-with numbers joined "
                            f"rounds apart)")
                    self.rounds[k] = r
                    self.round_files[k] = p
            except (KeyError, TypeError) as e:
                raise ValueError(f"{p}: a record without its {e} field") from None
            for field, value in aside.items():
                if isinstance(value, list):
                    kept = self.superseded.setdefault(field, [])
                    kept.extend(r for r in value if r not in kept)
                else:
                    self.superseded[field] = value
        return n

    def add(self, record: dict) -> None:
        """Stores a record (with workload, allocator, cap_gib, dim, size) and saves the file."""
        self.records[key(record["workload"], record["allocator"], record["cap_gib"],
                         record["dim"], record["size"])] = record
        self.save()

    def add_round(self, record: dict) -> None:
        """Stores a step-round run (a trial record with `round`) and saves the file."""
        self.rounds[round_key(record["workload"], record["allocator"], record["cap_gib"],
                              record["dim"], record["size"], record["round"])] = record
        self.save()

    def get_round(self, workload: str, allocator: str, cap_gib: float, dim: str, size: int,
                  round_: int) -> dict | None:
        return self.rounds.get(round_key(workload, allocator, cap_gib, dim, size, round_))

    def save(self) -> None:
        if not self.path:
            return
        tmp = self.path + ".tmp"
        doc = {"trials": list(self.records.values())}
        if self.rounds:
            doc["step_rounds"] = list(self.rounds.values())
        if self.superseded:
            doc["superseded"] = self.superseded
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, self.path)

    def known(self, workload: str, allocator: str, cap_gib: float, dim: str) -> dict[int, bool]:
        """size -> fits for one search's trials that ended with an answer."""
        return {r["size"]: r["fits"] for r in self.records.values()
                if (r["workload"], r["allocator"], r["dim"]) == (workload, allocator, dim)
                and r["cap_gib"] == cap_gib and r.get("fits") is not None}

    def get(self, workload: str, allocator: str, cap_gib: float, dim: str,
            size: int) -> dict | None:
        return self.records.get(key(workload, allocator, cap_gib, dim, size))

    def errors(self, workload: str, allocator: str, cap_gib: float, dim: str) -> list[dict]:
        return [r for r in self.records.values()
                if (r["workload"], r["allocator"], r["dim"]) == (workload, allocator, dim)
                and r["cap_gib"] == cap_gib and r.get("fits") is None]

    def groups(self) -> set[tuple[str, float, str]]:
        """(workload, cap, dimension) of every record."""
        return {(r["workload"], r["cap_gib"], r["dim"]) for r in self.records.values()}
