package cli

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/client"
)

// TestLsPools lists KV block pools after the objects, with their counts
// and bytes, and alone with --pools (a table, or JSON).
func TestLsPools(t *testing.T) {
	sock := serve(t)
	ctx := context.Background()
	c, err := client.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if table := mustRun(t, "ls", "--socket", sock); strings.Contains(table, "POOL") {
		t.Errorf("ls without pools shows a pool table: %q", table)
	}
	if _, err := c.CreatePool(ctx, "prefix-cache", client.PoolConfig{BlockBytes: 2 << 20, KeyBytes: 32, Capacity: 64 << 20, Shared: true}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.LookupBlocks(ctx, "prefix-cache", [][]byte{make([]byte, 32), make([]byte, 32)}, client.LookupOptions{}); err != nil {
		t.Fatal(err)
	}
	in := filepath.Join(t.TempDir(), "obj")
	if err := os.WriteFile(in, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	mustRun(t, "put", in, "--name", "obj", "--socket", sock)
	table := mustRun(t, "ls", "--socket", sock)
	objects, pools, ok := strings.Cut(table, "\n\n")
	if !ok || !strings.HasPrefix(objects, "NAME") || !strings.Contains(objects, "obj") {
		t.Fatalf("ls: %q", table)
	}
	lines := strings.Split(strings.TrimSpace(pools), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "POOL") {
		t.Fatalf("ls's pool table: %q", pools)
	}
	for _, want := range []string{"prefix-cache", "0/32", "64 MiB", "2 MiB", "host", "true"} {
		if !strings.Contains(lines[1], want) {
			t.Errorf("ls's pool line %q lacks %q", lines[1], want)
		}
	}
	var got []map[string]any
	if err := json.Unmarshal([]byte(mustRun(t, "ls", "--pools", "--json", "--socket", sock)), &got); err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0]["name"] != "prefix-cache" || got[0]["capacity_blocks"] != float64(32) || got[0]["misses"] != float64(2) || got[0]["blocks"] != float64(0) {
		t.Errorf("ls --pools --json: %v", got)
	}
	var objs []map[string]any
	if err := json.Unmarshal([]byte(mustRun(t, "ls", "--json", "--socket", sock)), &objs); err != nil || len(objs) != 1 {
		t.Errorf("ls --json lists objects only: %v, %v", objs, err)
	}
}
