"""The numerics that stand alone, no optimizer or callback: `ops`,
`StableSoftmax`, and the faults the other tests inject (`faults`)."""
