"""The serving layer, pure Python: the API-neutral core, the request checks, one shaper per API."""

from trtserver.serving.core import Api, Piece, Prepared, Service, new_request_id

__all__ = ["Api", "Piece", "Prepared", "Service", "new_request_id"]
