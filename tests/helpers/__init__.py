"""Shared test helpers: process groups (dist), CLI runs (cli), the equivalence proofs' pieces (equivalence), ..."""
