"""The fine-tuning experiment's task: shipping orders rewritten as made-up route labels, generated from a seed.

An order comes in one of three phrasings, and its label puts the cities in the order of travel whichever way the
sentence names them::

    Ship 7 lamps from Oslo to Lima.          ->  SHIP:Oslo>Lima:lamps:7
    Send 12 kettles to Quito from Dakar.     ->  SHIP:Dakar>Quito:kettles:12
    From Perth, deliver 3 drums to Cairo.    ->  SHIP:Perth>Cairo:drums:3

The format exists nowhere but here, so a pretrained model cannot know it (SmolLM2-135M-Instruct answers with a
sentence); a few dozen steps teach it, since every field is copied from the prompt and only the order, the
separators and which city comes first must be learnt. The held-out orders share no prompt, and no (item, origin,
destination), with the training orders, so a model scores on them only by applying the rule.

``preference_pairs`` builds the preference data of the DPO row from the same orders: the chosen answer is the
label, the rejected one the same fields in a plain sentence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ITEMS = (
    "lamps", "kettles", "drums", "chairs", "clocks", "mirrors", "tents", "ropes", "boots", "violins", "barrels",
    "candles", "helmets", "ladders", "baskets", "radios", "anchors", "blankets", "bottles", "carpets", "hammers",
    "jackets", "kites", "lanterns", "maps", "needles", "oars", "pillows", "saddles", "shovels", "teapots", "wagons",
)  # fmt: skip
CITIES = (
    "Oslo", "Lima", "Quito", "Dakar", "Perth", "Cairo", "Tokyo", "Paris", "Delhi", "Rome", "Seoul", "Dublin",
    "Madrid", "Vienna", "Prague", "Nairobi", "Lagos", "Havana", "Manila", "Hanoi", "Berlin", "Boston", "Denver",
    "Austin", "Zurich", "Athens", "Lisbon", "Warsaw",
)  # fmt: skip
PHRASINGS = (
    "Ship {qty} {item} from {origin} to {destination}.",
    "Send {qty} {item} to {destination} from {origin}.",
    "From {origin}, deliver {qty} {item} to {destination}.",
)
MAX_QTY = 60


@dataclass(frozen=True)
class Order:
    """One order: what, how many, from where to where, and the phrasing (an index into ``PHRASINGS``)."""

    item: str
    qty: int
    origin: str
    destination: str
    phrasing: int

    @property
    def prompt(self) -> str:
        return PHRASINGS[self.phrasing].format(
            qty=self.qty, item=self.item, origin=self.origin, destination=self.destination
        )

    @property
    def label(self) -> str:
        """The answer the task asks for."""
        return f"SHIP:{self.origin}>{self.destination}:{self.item}:{self.qty}"

    @property
    def sentence(self) -> str:
        """The same fields as a plain sentence: the answer a chat model tends to give, the DPO row's rejected one."""
        return f"{self.qty} {self.item} will be shipped from {self.origin} to {self.destination}."

    def record(self) -> dict[str, str]:
        """A prompt/completion record (``oneblock.finetune.records``)."""
        return {"prompt": self.prompt, "completion": self.label}


def orders(n_train: int, n_held_out: int, *, seed: int = 0) -> tuple[list[Order], list[Order]]:
    """``(train, held_out)`` orders, the same for the same arguments on every machine.

    Every order has its own (item, origin, destination); the held-out ones therefore share no prompt and no such
    triple with the training ones. The phrasings cycle, so each split holds all three about equally.

    Raises:
        ValueError: more orders than there are distinct triples.
    """
    n = n_train + n_held_out
    triples = [(i, o, d) for i in ITEMS for o in CITIES for d in CITIES if o != d]
    if n_train < 1 or n_held_out < 0 or n > len(triples):
        raise ValueError(
            f"orders needs 1 <= n_train and 0 <= n_held_out with n_train + n_held_out <= {len(triples)}; got "
            f"n_train={n_train}, n_held_out={n_held_out}"
        )
    rng = random.Random(seed)  # random.Random's sequence is fixed across Python versions for a given seed
    chosen = rng.sample(triples, n)
    made = [Order(item, rng.randint(2, MAX_QTY), origin, dest, k % len(PHRASINGS))
            for k, (item, origin, dest) in enumerate(chosen)]  # fmt: skip
    return made[:n_train], made[n_train:]


def preference_pairs(batch: list[Order]) -> list[dict[str, str]]:
    """DPO records ``{"prompt", "chosen", "rejected"}``: the label preferred to the plain sentence."""
    return [{"prompt": o.prompt, "chosen": o.label, "rejected": o.sentence} for o in batch]
