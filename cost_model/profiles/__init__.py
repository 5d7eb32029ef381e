"""Shipped cluster profiles (JSON)."""
