"""Draft alignment: alignment data from the target, the AtSpeed / KD losses, alignment training."""
