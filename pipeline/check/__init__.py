"""Looking at outputs: `validate` (rules in `rules`, facts in `facts`, sampling in `plan`, the
Beam job in `validate_beam`), `inspect`, and `report` (`figures`, `html`).
"""
