"""The operator's console (DESIGN section 14): HTML pages at `/` and /ui/..., served by the
HTTP door in the controller's own loop (handlers.py), with their pages, views, cookies and
static files."""
