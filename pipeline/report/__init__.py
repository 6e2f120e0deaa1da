"""What a fit shows its user: the HTML report, the plots, and the warnings about K."""
