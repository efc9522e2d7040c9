"""The caps and defaults of what one request asks for, the same at every door (the command line, the REST API, the
web pages): a page of the catalog, a similarity search's k, a map's points, a prediction's ids. Each door validates
against these and says the number in its error or help."""

from __future__ import annotations

#: adapters on one catalog page by default (`zoo list`, GET /api/v1/adapters, the search page)
DEFAULT_PER_PAGE = 20
#: the most adapters on one catalog page
MAX_PER_PAGE = 100
#: the last catalog page one may ask for: an offset every database holds
MAX_PAGE = 1_000_000
#: similar adapters returned by default (`zoo search`, GET /api/v1/adapters/{id}/similar, the similar page, an adapter's page)
DEFAULT_K = 10
#: the most similar adapters one search returns (the command line and the API)
MAX_K = 1000
#: the most the similar page shows: it renders each with its labels and the query's predictions beside them
MAX_PAGE_K = 100
#: points of a map by default, a deterministic spread of the space (`zoo map`, GET /api/v1/spaces/{name}/map)
DEFAULT_MAP_POINTS = 5_000
#: the most points one map request returns
MAX_MAP_POINTS = 100_000
#: the most adapters one prediction request names (adapter_ids)
MAX_PREDICTION_IDS = 100
