"""Developer tooling, kept apart from the product: the generator of doc/CONFIGURATION.md
(configuration_doc.py, `make docs`). Nothing in tierfs outside this package imports it
(tests/test_structure.py checks)."""
