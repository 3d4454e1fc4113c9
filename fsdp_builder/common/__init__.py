"""Building blocks every layer uses; they import nothing of the library but its errors."""
