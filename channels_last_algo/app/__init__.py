"""The application: the NHWC data path, YAML recipes on Composer's Trainer, the side-by-side
comparison, model lookup by name, the demo and the ``channels-last`` command. It builds on the
core and the integrations; nothing below imports from here."""
