"""The REST adapter: the route table (``routes``), its endpoints grouped by resource
(``endpoints``), the middleware every request goes through (``middleware``) and what the
endpoints read and answer with (``io``). This package loads nothing itself."""
