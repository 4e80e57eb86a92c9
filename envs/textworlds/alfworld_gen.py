"""ALFWorld games generated from the PDDL domain and grammar shipped in the alfworld wheel.

ALFWorld's own game files need a download; instead a household is sampled here — a room (kitchen,
living room, bedroom, bathroom) with receptacles at their own locations and objects inside them, using
the wheel's tables of which receptacle can hold which object and which objects can be cleaned, heated,
cooled or toggled — and the goal of one of ALFWorld's six task types is taken from the wheel's goal
library. The result is a ``.tw-pddl`` game (``pddl_domain`` + ``grammar`` + ``pddl_problem``) that the
alfworld TextWorld wrappers play like a real one. Generation is a pure function of (task type, seed).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
SHORT_NAMES = {
    "pick": "pick_and_place_simple",
    "look": "look_at_obj_in_light",
    "clean": "pick_clean_then_place_in_recep",
    "heat": "pick_heat_then_place_in_recep",
    "cool": "pick_cool_then_place_in_recep",
    "two": "pick_two_obj_and_place",
}

# receptacle type -> (min, max) count, per room kind (our own household layouts)
ROOMS: dict[str, dict[str, tuple[int, int]]] = {
    "Kitchen": {
        "Cabinet": (3, 6), "CounterTop": (1, 2), "Drawer": (1, 3), "Fridge": (1, 1), "Microwave": (1, 1),
        "SinkBasin": (1, 1), "StoveBurner": (2, 4), "GarbageCan": (1, 1), "CoffeeMachine": (1, 1),
        "Toaster": (1, 1), "DiningTable": (0, 1), "Shelf": (0, 2),
    },
    "LivingRoom": {
        "Sofa": (1, 1), "ArmChair": (0, 2), "CoffeeTable": (1, 1), "SideTable": (1, 2), "TVStand": (1, 1),
        "Drawer": (1, 3), "Shelf": (1, 3), "Dresser": (0, 1), "GarbageCan": (1, 1), "Cabinet": (0, 3),
    },
    "Bedroom": {
        "Bed": (1, 1), "Desk": (1, 1), "Drawer": (2, 4), "Dresser": (1, 1), "Shelf": (1, 3),
        "SideTable": (1, 2), "GarbageCan": (1, 1), "LaundryHamper": (0, 1), "Safe": (0, 1),
        "ArmChair": (0, 1),
    },
    "Bathroom": {
        "BathtubBasin": (1, 1), "SinkBasin": (1, 2), "Toilet": (1, 1), "ToiletPaperHanger": (1, 1),
        "TowelHolder": (1, 1), "HandTowelHolder": (1, 1), "CounterTop": (1, 1), "Cabinet": (2, 4),
        "Drawer": (0, 3), "GarbageCan": (1, 1), "Shelf": (0, 2),
    },
}
LAMP_HOLDERS = ("Desk", "SideTable", "Dresser")
APPLIANCE = {  # the receptacle a task's state change needs
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
PROPERTY = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}


def resolve_task_type(name: str) -> str:
    """Full ALFWorld task-type name from a full or short name (pick, look, clean, heat, cool, two)."""
    full = SHORT_NAMES.get(name, name)
    if full not in TASK_TYPES:
        raise ValueError(f"unknown ALFWorld task type {name!r} (known: {', '.join(TASK_TYPES)} or "
                         f"{', '.join(SHORT_NAMES)})")
    return full


def _coord(v: float) -> str:
    sign = "_plus_" if v >= 0 else "_minus_"
    return sign + f"{abs(v):05.2f}".replace(".", "_dot_")


def _mangle(kind: str, rng: random.Random, used: set[str]) -> str:
    """An ALFRED-style id: ``Type_bar_<x>_bar_<y>_bar_<z>`` (basins carry their own suffix)."""
    while True:
        xyz = [round(rng.uniform(-3.0, 3.0), 2) for _ in range(3)]
        base = "_bar_".join(_coord(v) for v in xyz)
        if kind == "SinkBasin":
            name = f"Sink_bar_{base}_bar_SinkBasin"
        elif kind == "BathtubBasin":
            name = f"Bathtub_bar_{base}_bar_BathtubBasin"
        else:
            name = f"{kind}_bar_{base}"
        if name not in used:
            used.add(name)
            return name


def _tables() -> tuple[dict[str, set[str]], dict[str, set[str]], list[str], set[str], list[str]]:
    import alfworld.gen.constants as C

    holds = {r: {o for o in objs if "Sliced" not in o} for r, objs in C.VAL_RECEPTACLE_OBJECTS.items()}
    props = {k: set(v) for k, v in C.VAL_ACTION_OBJECTS.items()}
    openable = set(C.OPENABLE_CLASS_LIST)
    basins = {"SinkBasin", "BathtubBasin"}
    receptacle_types = sorted((set(C.RECEPTACLES) - set(C.MOVABLE_RECEPTACLES)) | basins)
    object_types = sorted((set(C.OBJECTS) | set(C.MOVABLE_RECEPTACLES)) - set(receptacle_types))
    return holds, props, object_types, openable, receptacle_types


def generate_game(task_type: str, seed: int) -> dict[str, Any]:
    """A solvable-by-construction ALFWorld game of ``task_type`` (full or short name) for ``seed``."""
    import alfworld.gen.constants as C
    import alfworld.gen.goal_library as glib
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    task_type = resolve_task_type(task_type)
    rng = random.Random(f"alfworld-gen:{task_type}:{int(seed)}")
    holds, props, object_types, openable, receptacle_types = _tables()
    room = rng.choice(sorted(C.GOALS_VALID[task_type]))
    used: set[str] = set()

    receptacles: list[tuple[str, str]] = []  # (id, type)
    for rtype, (lo, hi) in ROOMS[room].items():
        for _ in range(rng.randint(lo, hi)):
            receptacles.append((_mangle(rtype, rng, used), rtype))
    rtypes = sorted({t for _, t in receptacles})
    placeable = {
        o: sorted(r for r in rtypes if o in holds.get(r, ()))
        for o in object_types
        if o not in ("DeskLamp", "FloorLamp")
    }
    placeable = {o: rs for o, rs in placeable.items() if rs}

    # --- the goal ----------------------------------------------------------------------------------
    params = {"obj": "", "recep": "", "toggle": "", "mrecep": ""}
    appliance = APPLIANCE.get(task_type)
    if task_type == "look_at_obj_in_light":
        holders = [t for t in LAMP_HOLDERS if t in rtypes]
        if not holders:  # make sure a lamp has a place to stand
            receptacles.append((_mangle("SideTable", rng, used), "SideTable"))
            rtypes = sorted({t for _, t in receptacles})
            holders = ["SideTable"]
        params["toggle"] = "DeskLamp"
        candidates = sorted(placeable)
        obj = rng.choice(candidates)
    else:
        prop = PROPERTY.get(task_type)
        candidates = sorted(
            o for o, rs in placeable.items()
            if (prop is None or o in props[prop]) and any(r != appliance for r in rs)
        )
        obj = rng.choice(candidates)
        targets = [r for r in placeable[obj] if r != appliance]
        if len(placeable[obj]) > 1:  # keep at least one other place for the objects to start in
            targets = [r for r in targets if any(s != r for s in placeable[obj])] or targets
        params["recep"] = rng.choice(targets)
    params["obj"] = obj

    # --- objects -----------------------------------------------------------------------------------
    objects: list[tuple[str, str, str]] = []  # (id, type, receptacle id)
    by_type: dict[str, list[str]] = {}
    for rid, rtype in receptacles:
        by_type.setdefault(rtype, []).append(rid)

    def place(otype: str, avoid: str | None) -> None:
        options = [r for r in placeable[otype] if r != avoid] or placeable[otype]
        rtype = rng.choice(options)
        objects.append((_mangle(otype, rng, used), otype, rng.choice(by_type[rtype])))

    n_target = rng.randint(2, 3) if task_type == "pick_two_obj_and_place" else rng.randint(1, 2)
    for _ in range(n_target):
        place(obj, params["recep"] or None)
    distractors = [o for o in sorted(placeable) if o != obj]
    for otype in rng.sample(distractors, k=min(len(distractors), rng.randint(8, 14))):
        for _ in range(rng.randint(1, 2)):
            place(otype, None)
    if params["toggle"]:
        holder = rng.choice([t for t in LAMP_HOLDERS if t in by_type])
        objects.append((_mangle("DeskLamp", rng, used), "DeskLamp", rng.choice(by_type[holder])))

    # --- locations and facts ---------------------------------------------------------------------------
    loc_of: dict[str, str] = {}
    spots = rng.sample(range(1, 400), k=len(receptacles) + 1)
    for (rid, _), spot in zip(receptacles, spots[1:], strict=False):
        turn, tilt = rng.randint(0, 3), rng.choice((0, 30, 60))
        loc_of[rid] = f"loc_bar_{spot // 20}_bar_{spot % 20}_bar_{turn}_bar_{tilt}"
    start = f"loc_bar_{spots[0] // 20}_bar_{spots[0] % 20}_bar_{rng.randint(0, 3)}_bar_45"
    facts = [f"(atLocation agent1 {start})"]
    for rid, rtype in receptacles:
        facts.append(f"(receptacleType {rid} {rtype}Type)")
        facts.append(f"(receptacleAtLocation {rid} {loc_of[rid]})")
        if rtype in openable:
            facts.append(f"(openable {rid})")
    otypes_here = sorted({t for _, t, _ in objects})
    for rtype in rtypes:
        for otype in otypes_here:
            if otype in holds.get(rtype, ()):
                facts.append(f"(canContain {rtype}Type {otype}Type)")
    for oid, otype, rid in objects:
        facts.append(f"(objectType {oid} {otype}Type)")
        facts.append(f"(inReceptacle {oid} {rid})")
        facts.append(f"(objectAtLocation {oid} {loc_of[rid]})")
        if otype == "DeskLamp":
            facts.append(f"(toggleable {oid})")
            continue
        facts.append(f"(pickupable {oid})")
        for prop, pred in (("Cleanable", "cleanable"), ("Heatable", "heatable"), ("Coolable", "coolable"),
                           ("Sliceable", "sliceable")):
            if otype in props[prop]:
                facts.append(f"({pred} {oid})")
        if otype in C.MOVABLE_RECEPTACLES:
            facts.append(f"(isReceptacleObject {oid})")

    declared = (
        ["agent1 - agent"]
        + [f"{loc} - location" for loc in [start, *loc_of.values()]]
        + [f"{rid} - receptacle" for rid, _ in receptacles]
        + [f"{oid} - object" for oid, _, _ in objects]
        + [f"{t}Type - otype" for t in sorted(set(object_types) | {"DeskLamp"})]
        + [f"{t}Type - rtype" for t in receptacle_types]
    )
    goal = glib.gdict[task_type]["pddl"].replace("#", "-").format(**params)
    name = f"gen_{task_type}_{int(seed)}"
    problem = (
        f"(define (problem {name})\n(:domain alfred)\n(:objects\n        "
        + "\n        ".join(declared)
        + "\n        )\n(:init\n        "
        + "\n        ".join(facts)
        + "\n        )\n"
        + goal
    )
    template = rng.choice(glib.gdict[task_type]["templates"])
    words = {k: v.lower() for k, v in params.items()}
    description = template.format(**words)
    with open(ALFRED_TWL2_PATH) as f:
        grammar = f.read().replace("UNKNOWN GOAL", description)
    with open(ALFRED_PDDL_PATH) as f:
        domain = f.read()
    return {
        "pddl_domain": domain,
        "grammar": grammar,
        "pddl_problem": problem,
        "solvable": True,
        "task_type": task_type,
        "room": room,
        "params": params,
        "task_desc": description,
        "seed": int(seed),
    }


def generated_tasks(part: str, count: int, task_types: Sequence[str] | None = None) -> list[str]:
    """``count`` generated-task names ``gen:<type>:<seed>`` cycling over task types.

    Train and test use disjoint seed ranges (train from 0, dev from 500000, test from 1000000).
    """
    offsets = {"train": 0, "dev": 500_000, "test": 1_000_000}
    if part not in offsets:
        raise ValueError(f"ALFWorld split part must be one of {tuple(offsets)}, got {part!r}")
    types = [resolve_task_type(t) for t in (task_types or TASK_TYPES)]
    return [f"gen:{types[i % len(types)]}:{offsets[part] + i}" for i in range(int(count))]
