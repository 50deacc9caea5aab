package store

import (
	"bytes"
	"context"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/cudaipc/cudaipc/protocol"
)

// vouchingCluster is a ClusterHook that vouches (MayEvict) for the names
// in elsewhere: another live node holds them.
type vouchingCluster struct {
	nopCluster
	mu        sync.Mutex
	elsewhere map[string]bool
	asked     [][]string
}

func (h *vouchingCluster) Sealed(_ context.Context, co ClusterObject) (string, error) {
	return "id-" + co.Name, nil
}

func (h *vouchingCluster) MayEvict(_ context.Context, objs []ClusterObject) []bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	ok := make([]bool, len(objs))
	var names []string
	for i, co := range objs {
		names = append(names, co.Name)
		ok[i] = h.elsewhere[co.Name] && co.ID == "id-"+co.Name
	}
	slices.Sort(names)
	h.asked = append(h.asked, names)
	return ok
}

func (h *vouchingCluster) vouch(name string) {
	h.mu.Lock()
	h.elsewhere[name] = true
	h.mu.Unlock()
}

// putCluster creates, fills with random bytes, seals and publishes a
// cluster-visible object.
func (c *testClient) putCluster(name string, size int64) []byte {
	c.t.Helper()
	p, _, err := c.ss.create(createReq{name: name, size: size, cluster: true})
	if err != nil {
		c.t.Fatalf("create %q: %v", name, err)
	}
	data := randomBytes(size)
	copy(c.mapping(p), data)
	if err := c.ss.sealName(name); err != nil {
		c.t.Fatalf("seal %q: %v", name, err)
	}
	if err := c.ss.clusterSealed(context.Background(), name, 0, 0); err != nil {
		c.t.Fatalf("publish %q: %v", name, err)
	}
	return data
}

// A cluster-visible object is evicted to make room only when the cluster
// vouches, for that create, that another live node holds it: the last
// copy stays (and keeps its bytes) where the least recently used order
// would have taken it first; a create that only its eviction could serve
// fails STORE_FULL saying what holds the room, evicting nothing; once
// the cluster vouches for it, the next create may take it.
func TestEvictionSparesLastCopies(t *testing.T) {
	h := &vouchingCluster{elsewhere: map[string]bool{"repl": true}}
	// One 64 KiB arena: 16 objects of 4 KiB.
	s := newTestStore(t, Config{Capacity: 64 << 10, Cluster: h})
	c := connect(t, s, 1000)
	ev, err := c.ss.subscribe()
	if err != nil {
		t.Fatal(err)
	}
	evicted := func() []string {
		var names []string
		for len(ev) > 0 {
			if e := <-ev; e.kind == eventEvicted {
				_, n, _ := protocol.SplitOwner(e.name)
				names = append(names, n)
			}
		}
		return names
	}
	last := c.putCluster("1000:last", 4096)
	c.putCluster("1000:repl", 4096)
	var local []string
	for i := range 14 {
		name := "1000:l" + string(rune('a'+i))
		c.put(name, 4096, false)
		local = append(local, name)
	}
	evicted()
	c.put("1000:x", 4096, false)
	if got := evicted(); !slices.Equal(got, []string{"repl"}) {
		t.Fatalf("evicted %v, want only repl (held elsewhere); last is the cluster's only copy", got)
	}
	if len(h.asked) != 1 || !slices.Equal(h.asked[0], []string{"last", "repl"}) {
		t.Fatalf("the hook was asked %v, want once, of last and repl", h.asked)
	}
	lp, b := c.get("1000:last")
	if !bytes.Equal(b, last) {
		t.Fatal("the last copy's bytes changed")
	}
	if err := c.ss.release(lp.leaseID); err != nil {
		t.Fatal(err)
	}
	// Everything else leased: only last could go, and may not.
	for _, name := range append(local, "1000:x") {
		c.get(name)
	}
	_, err = c.ss.createObject("1000:y", 4096, "", false)
	wantErr(t, err, ErrStoreFull)
	for _, want := range []string{"device host", "1 object, 4 KiB, is a last copy in the cluster", "15 objects, 60 KiB, are leased"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("STORE_FULL error %q does not say %q", err, want)
		}
	}
	if got := evicted(); len(got) != 0 {
		t.Fatalf("a create that failed evicted %v", got)
	}
	// The hook's word is asked for each create, never remembered.
	h.vouch("last")
	c.put("1000:y", 4096, false)
	if got := evicted(); !slices.Equal(got, []string{"last"}) {
		t.Fatalf("evicted %v once the cluster vouched for last, want last", got)
	}
	if len(h.asked) != 3 {
		t.Fatalf("the hook was asked %d times, want 3 (one per create that needed it)", len(h.asked))
	}
}
