"""The package's version, in one place: setup.py reads this file, `megatron_mecefo.__version__`
imports it, and every run reports it (`mecefo-launch --version`, the start-up banner, each rank's
`started` event). CHANGELOG.md says what each version changed."""

__version__ = "0.2.0"
