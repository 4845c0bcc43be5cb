"""Pallas TPU stages of the megakernel, one module per stage, composed by megakernel.py."""
