"""MovieLens as sequences: every rating of a user, oldest first, enriched with the movie's genre and year.

    python -m jaxscale.sequences import movielens --path recbole-1.2.1-py3-none-any.whl --out data/ml-100k
    python -m jaxscale.sequences compile experiments/movielens/movielens_defs.py --out data/ml-100k/defs.json
    python -m jaxscale.sequences backfill --defs data/ml-100k/defs.json --events data/ml-100k/events \
        --items data/ml-100k/items.parquet --out data/ml-100k/store

The importer (`jaxscale.sequences.movielens`) writes ratings as raw events `rate_1`..`rate_5` (rating
rounded half up) on the surface "rating", in the ratings file's order (the tie order of equal timestamps),
and the items table with `category` (index of the movie's first genre in `movielens.GENRES`, -1 none),
`year` (-1 unknown) and `genres` (`|`-joined).
"""

from jaxscale.sequences import Definitions, Enrichment, EventType, Sequence

RATE_1 = EventType("rate_1")
RATE_2 = EventType("rate_2")
RATE_3 = EventType("rate_3")
RATE_4 = EventType("rate_4")
RATE_5 = EventType("rate_5")

ITEMS = Enrichment(
    "items",
    key="item_id",
    fields={"category": "int64", "year": "int64", "genres": "string"},
    defaults={"category": -1, "year": -1, "genres": ""},
)

RATINGS = Sequence(
    "ratings",
    event_types=("rate_1", "rate_2", "rate_3", "rate_4", "rate_5"),
    fields=("item_id", "ts", "event_type", "surface", "category", "year"),
    max_length=4096,  # the whole history of every user (ml-100k's heaviest rater has 737 ratings, ml-1m's 2,314)
    engaged=("rate_4", "rate_5"),  # the training reader's `engaged` label: a liked movie
    vocabularies=("item_id",),  # dense item ids: 0 padding, 1 out of vocabulary, movies from 2 (most rated first)
)

DEFINITIONS = Definitions(
    event_types=(RATE_1, RATE_2, RATE_3, RATE_4, RATE_5),
    enrichments=(ITEMS,),
    sequences=(RATINGS,),
    surfaces=("rating",),
)
