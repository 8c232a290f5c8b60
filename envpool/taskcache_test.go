package envpool

import (
	"strconv"
	"testing"
)

func TestTaskCacheEvictsLeastRecentlyUsed(t *testing.T) {
	c := newTaskCache()
	for i := range maxTasks {
		if ev := c.put(strconv.Itoa(i), task{checkpoint: "ck-" + strconv.Itoa(i)}); ev != "" {
			t.Fatalf("evicted %s below the bound", ev)
		}
	}
	if _, ok := c.get("0"); !ok { // task 0 is now the most recently used
		t.Fatal("task 0 missing")
	}
	if ev := c.put("new", task{checkpoint: "ck-new"}); ev != "ck-1" {
		t.Fatalf("evicted %q, want ck-1 (the least recently used)", ev)
	}
	if _, ok := c.get("1"); ok {
		t.Fatal("evicted task still cached")
	}
	if n := c.len(); n != maxTasks {
		t.Fatalf("%d tasks cached, want %d", n, maxTasks)
	}
}
