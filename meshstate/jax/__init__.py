"""JAX's programming model over a mesh: partition specs, placements, named collectives."""
