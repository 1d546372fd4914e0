"""Adapters that put megacritic into other projects' RL trainers. Each imports its peer lazily: megacritic
itself never needs them."""
