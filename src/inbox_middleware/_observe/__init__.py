"""What each decision leaves behind: metric samples and trace spans."""
