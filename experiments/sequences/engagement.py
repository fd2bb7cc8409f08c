"""The shipped example: the `engagement` sequence (click, save, closeup), enriched with the item's category.

Item ids get a dense vocabulary in the store (`vocabularies`): the log's 40-bit ids become indices 2.. in
frequency order (0 padding, 1 out-of-vocabulary), so the models' item tables hold them without hashing.

python -m jaxscale.sequences compile experiments/sequences/engagement.py --out defs.json
"""

from jaxscale.sequences import Definitions, Enrichment, EventType, Sequence

CLICK = EventType("click", raw=("click", "pin_click"))
SAVE = EventType("save", raw=("save", "repin"))
CLOSEUP = EventType("closeup")

ITEMS = Enrichment("items", key="item_id", fields={"category": "int64"}, defaults={"category": -1})

ENGAGEMENT = Sequence(
    "engagement",
    event_types=("click", "save", "closeup"),
    fields=("item_id", "ts", "event_type", "surface", "category"),
    max_length=256,
    engaged=("save",),
    vocabularies=("item_id",),
)

DEFINITIONS = Definitions(
    event_types=(CLICK, SAVE, CLOSEUP),
    enrichments=(ITEMS,),
    sequences=(ENGAGEMENT,),
    surfaces=("home_feed", "search", "related"),
)
