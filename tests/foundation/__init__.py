# A package, so that these test modules' names cannot collide with other test directories'.
