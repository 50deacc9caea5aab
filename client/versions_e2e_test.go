package client_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// shardContent is what shard shard of version v of name holds: every
// process can check any other's writes.
func shardContent(name string, v uint64, shard, size int) []byte {
	return stream(v, fmt.Sprintf("%s/%d", name, shard), size)
}

func envInt(k string) int {
	n, _ := strconv.Atoi(os.Getenv(k))
	return n
}

func init() {
	// Creates shard SHARD of SHARDS of the next version of NAME (SIZE
	// bytes), says "created V", then seals on the line "seal" from stdin,
	// or waits to be killed.
	gpuRoles["v-shard"] = func(ctx context.Context, c *client.Client, say func(string, ...any)) error {
		name, size, shard := os.Getenv("NAME"), envInt("SIZE"), envInt("SHARD")
		o, err := c.Publish(ctx, name, int64(size), client.CreateOptions{Shards: envInt("SHARDS"), Shard: shard})
		if err != nil {
			return err
		}
		if _, err := o.WriteAt(shardContent(name, o.Version(), shard, size), 0); err != nil {
			return err
		}
		say("created %d", o.Version())
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			if in.Text() == "seal" {
				if err := o.Seal(ctx); err != nil {
					return err
				}
				say("sealed")
			}
		}
		return nil
	}
	// Leases the latest version of NAME (or VERSION), checks every shard
	// of it, says "leased V", and holds until killed or stdin closes.
	gpuRoles["v-holder"] = func(ctx context.Context, c *client.Client, say func(string, ...any)) error {
		name := os.Getenv("NAME")
		l, err := c.GetWith(ctx, name, client.GetOptions{Version: uint64(envInt("VERSION"))})
		if err != nil {
			return err
		}
		v := l.Info().Version
		if err := checkVersion(ctx, c, l); err != nil {
			return err
		}
		say("leased %d", v)
		bufio.NewScanner(os.Stdin).Scan()
		return l.Release()
	}
}

// checkVersion checks that every shard of the version l holds is intact.
func checkVersion(ctx context.Context, c *client.Client, l *client.Lease) error {
	in := l.Info()
	for s := 0; s < max(in.Shards, 1); s++ {
		sl := l
		if s != in.Shard {
			var err error
			if sl, err = c.GetWith(ctx, in.Name, client.GetOptions{Version: in.Version, Shard: s}); err != nil {
				return fmt.Errorf("shard %d of version %d: %w", s, in.Version, err)
			}
			defer sl.Release()
		}
		if got := sl.Info(); got.Version != in.Version || got.Shard != s {
			return fmt.Errorf("asked for shard %d of version %d, got shard %d of %d", s, in.Version, got.Shard, got.Version)
		}
		if !bytes.Equal(sl.Bytes(), shardContent(in.Name, in.Version, s, int(sl.Size()))) {
			return fmt.Errorf("shard %d of version %d: bytes differ (mixed or half-written version)", s, in.Version)
		}
	}
	return nil
}

// publish writes and seals the next version of name in one shard.
func publish(t *testing.T, c *client.Client, name string, size int, opts client.CreateOptions) uint64 {
	t.Helper()
	ctx := context.Background()
	o, err := c.Publish(ctx, name, int64(size), opts)
	if err != nil {
		t.Fatalf("publish %s: %v", name, err)
	}
	copy(o.Bytes(), shardContent(name, o.Version(), opts.Shard, size))
	if err := o.Seal(ctx); err != nil {
		t.Fatalf("seal %s v%d: %v", name, o.Version(), err)
	}
	return o.Version()
}

func getVersion(c *client.Client, name string, v uint64) (*client.Lease, error) {
	// Long enough for the daemon to answer "not yet" (TIMEOUT) itself.
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	return c.GetWith(ctx, name, client.GetOptions{Version: v, Wait: true})
}

// waitGone polls until version v of name is reclaimed (a dead reader's
// leases end asynchronously; there is no event for that).
func waitGone(t *testing.T, c *client.Client, name string, v uint64) {
	t.Helper()
	testutil.Eventually(t, testutil.Wait, func() error {
		l, err := getVersion(c, name, v)
		if errors.Is(err, client.ErrNotFound) {
			return nil
		}
		if err != nil {
			t.Fatalf("get v%d: %v", v, err)
		}
		l.Release()
		return fmt.Errorf("%s v%d not reclaimed yet", name, v)
	})
}

func TestVersionReaderHoldsOldVersion(t *testing.T) {
	// 8 MiB without eviction: 40 versions of 1 MiB fit only if the
	// superseded ones are reclaimed.
	d := startDaemon(t, socketPath(t), "CAPACITY=8388608", "NOEVICT=1")
	c := dial(t, d.socket)
	ctx := context.Background()
	const size = 1 << 20
	events, err := c.Subscribe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for want := uint64(1); want <= 3; want++ {
		if v := publish(t, c, "w", size, client.CreateOptions{}); v != want {
			t.Fatalf("published version %d, want %d", v, want)
		}
	}
	h := spawn(t, "v-holder", nil, "CUDAIPC_SOCKET="+d.socket, "NAME=w")
	if v := h.expect("leased "); v != "3" {
		t.Fatalf("holder leased version %s, want 3", v)
	}
	publish(t, c, "w", size, client.CreateOptions{})
	publish(t, c, "w", size, client.CreateOptions{})
	// The latest is 5; 3 is held, so still readable by number; 4 was
	// superseded with no lease and is gone; so are 1 and 2.
	l, err := c.GetWith(ctx, "w", client.GetOptions{})
	if err != nil || l.Info().Version != 5 {
		t.Fatalf("latest: %v %+v", err, l.Info())
	}
	if err := checkVersion(ctx, c, l); err != nil {
		t.Fatal(err)
	}
	l.Release()
	l3, err := getVersion(c, "w", 3)
	if err != nil {
		t.Fatalf("v3 while a reader holds it: %v", err)
	}
	if err := checkVersion(ctx, c, l3); err != nil {
		t.Fatal(err)
	}
	l3.Release()
	for _, v := range []uint64{1, 2, 4} {
		if _, err := getVersion(c, "w", v); !errors.Is(err, client.ErrNotFound) {
			t.Fatalf("v%d after it was superseded: %v, want ErrNotFound", v, err)
		}
	}
	// A version above the latest is not there yet.
	if _, err := getVersion(c, "w", 6); !errors.Is(err, client.ErrTimeout) {
		t.Fatalf("v6 before it is published: %v, want ErrTimeout", err)
	}
	// The reader dies holding v3: v3 goes.
	h.kill9()
	waitGone(t, c, "w", 3)
	// Subscribers heard of every version, in order.
	for want := uint64(1); want <= 5; want++ {
		ev := testutil.Next(t, events, testutil.Wait)
		if ev.Kind != client.EventSealed || ev.Name != "w" || ev.Version != want {
			t.Fatalf("event %+v, want sealed w v%d", ev, want)
		}
	}
	for i := 0; i < 40; i++ {
		publish(t, c, "w", size, client.CreateOptions{})
	}
	info, err := c.Stat(ctx, "w")
	if err != nil || info.Version != 45 {
		t.Fatalf("stat: %v %+v", err, info)
	}
	// A plain Get of a versioned name is its latest version.
	l, err = c.Get(ctx, "w")
	if err != nil || l.Info().Version != 45 {
		t.Fatalf("Get: %v", err)
	}
	l.Release()
	if err := c.Delete(ctx, "w"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Stat(ctx, "w"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("stat after delete: %v", err)
	}
}

func TestVersionKeepLast(t *testing.T) {
	d := startDaemon(t, socketPath(t), "KEEP_VERSIONS=2")
	c := dial(t, d.socket)
	for i := 0; i < 5; i++ {
		publish(t, c, "daemon-default", 4096, client.CreateOptions{})
		publish(t, c, "per-name", 4096, client.CreateOptions{KeepLast: 3})
	}
	for name, kept := range map[string]uint64{"daemon-default": 2, "per-name": 3} {
		for v := uint64(1); v <= 5; v++ {
			l, err := getVersion(c, name, v)
			if v > 5-kept {
				if err != nil {
					t.Fatalf("%s v%d should be kept: %v", name, v, err)
				}
				if err := checkVersion(context.Background(), c, l); err != nil {
					t.Fatal(err)
				}
				l.Release()
			} else if !errors.Is(err, client.ErrNotFound) {
				t.Fatalf("%s v%d should be reclaimed: %v", name, v, err)
			}
		}
	}
	// Not versioned: a plain object of that name is refused, and the
	// other way round.
	if _, err := c.Create(context.Background(), "per-name", 10, client.CreateOptions{}); !errors.Is(err, client.ErrExists) {
		t.Fatalf("plain create over a versioned name: %v", err)
	}
	put(t, c, "plain", 10)
	if _, err := c.Publish(context.Background(), "plain", 10, client.CreateOptions{}); !errors.Is(err, client.ErrExists) {
		t.Fatalf("publish over a plain name: %v", err)
	}
}

func TestShardedVersionCreatorKilled(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c := dial(t, d.socket)
	ctx := context.Background()
	events, err := c.Subscribe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	env := []string{"CUDAIPC_SOCKET=" + d.socket, "NAME=tp", "SIZE=300000", "SHARDS=2"}
	s0 := spawn(t, "v-shard", nil, append(env, "SHARD=0")...)
	s1 := spawn(t, "v-shard", nil, append(env, "SHARD=1")...)
	if v0, v1 := s0.expect("created "), s1.expect("created "); v0 != "1" || v1 != "1" {
		t.Fatalf("shards created in versions %s and %s, want both 1", v0, v1)
	}
	// A reader waits for the first version meanwhile.
	got := make(chan error, 1)
	go func() {
		l, err := c.WaitNewer(ctx, "tp", 0)
		if err == nil {
			if l.Info().Version != 2 {
				err = fmt.Errorf("first visible version is %d, want 2", l.Info().Version)
			} else {
				err = checkVersion(ctx, c, l)
			}
			l.Release()
		}
		got <- err
	}()
	fmt.Fprintln(s0.in, "seal")
	s0.expect("sealed")
	// Half sealed: not visible.
	if _, err := getVersion(c, "tp", 1); !errors.Is(err, client.ErrTimeout) {
		t.Fatalf("get of a half-sealed version: %v, want ErrTimeout", err)
	}
	s1.kill9()
	ev := testutil.Next(t, events, testutil.Wait)
	if ev.Kind != client.EventAborted || ev.Version != 1 {
		t.Fatalf("event %+v, want aborted v1", ev)
	}
	// Version 1 never becomes visible, even to a reader asking for it.
	if _, err := getVersion(c, "tp", 1); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("get of the aborted version: %v, want ErrNotFound", err)
	}
	s0.in.Close()
	// The next attempt succeeds; the waiting reader sees it whole.
	s2 := spawn(t, "v-shard", nil, append(env, "SHARD=0")...)
	s3 := spawn(t, "v-shard", nil, append(env, "SHARD=1")...)
	if v2, v3 := s2.expect("created "), s3.expect("created "); v2 != "2" || v3 != "2" {
		t.Fatalf("retry created versions %s and %s, want 2", v2, v3)
	}
	fmt.Fprintln(s3.in, "seal")
	s3.expect("sealed")
	fmt.Fprintln(s2.in, "seal")
	s2.expect("sealed")
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	ev = testutil.Next(t, events, testutil.Wait)
	if ev.Kind != client.EventSealed || ev.Version != 2 {
		t.Fatalf("event %+v, want sealed v2", ev)
	}
	// A reader holding a sharded version, killed: the version goes once
	// superseded.
	h := spawn(t, "v-holder", nil, "CUDAIPC_SOCKET="+d.socket, "NAME=tp")
	h.expect("leased 2")
	o0, err := c.Publish(ctx, "tp", 10, client.CreateOptions{Shards: 2, Shard: 0})
	if err != nil {
		t.Fatal(err)
	}
	o1, err := c.Publish(ctx, "tp", 10, client.CreateOptions{Shards: 2, Shard: 1})
	if err != nil || o0.Version() != 3 || o1.Version() != 3 {
		t.Fatalf("publish v3: %v", err)
	}
	copy(o0.Bytes(), shardContent("tp", 3, 0, 10))
	copy(o1.Bytes(), shardContent("tp", 3, 1, 10))
	if err := o0.Seal(ctx); err != nil {
		t.Fatal(err)
	}
	if err := o1.Seal(ctx); err != nil {
		t.Fatal(err)
	}
	if l, err := getVersion(c, "tp", 2); err != nil {
		t.Fatalf("v2 while held: %v", err)
	} else {
		l.Release()
	}
	h.kill9()
	waitGone(t, c, "tp", 2)
}

func TestBundleBetweenProcesses(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c := dial(t, d.socket)
	ctx := context.Background()
	for _, n := range []int{1, 100_000} {
		name := fmt.Sprintf("bundle-%d", n)
		tensors := make([]client.TensorData, n)
		for i := range tensors {
			dt := bundle.DTypes[i%len(bundle.DTypes)]
			shape := []int64{int64(1 + i%3), 8}
			sz, err := bundle.ByteSize(dt, shape)
			if err != nil {
				t.Fatal(err)
			}
			tn := fmt.Sprintf("model.layers.%d.weight", i)
			tensors[i] = client.TensorData{Spec: bundle.Spec{Name: tn, DType: dt, Shape: shape}, Data: stream(uint64(n), tn, int(sz))}
		}
		if _, err := c.PutBundle(ctx, name, tensors, map[string]string{"format": "pt"}, client.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		r := spawn(t, "b-reader", nil, "CUDAIPC_SOCKET="+d.socket, "NAME="+name, fmt.Sprintf("COUNT=%d", n))
		if got := r.expect("ok "); got != strconv.Itoa(n) {
			t.Fatalf("reader checked %s tensors, want %d", got, n)
		}
		info, err := c.Stat(ctx, name)
		if err != nil || info.Tensors != n || info.ManifestSize == 0 {
			t.Fatalf("stat: %v %+v", err, info)
		}
	}
	// A plain object is not a bundle.
	put(t, c, "plain", 10)
	if _, _, err := c.GetBundle(ctx, "plain", client.GetOptions{}); !errors.Is(err, client.ErrNotBundle) {
		t.Fatalf("GetBundle of a plain object: %v", err)
	}
	// A manifest that does not fit the object is refused at seal.
	o, err := c.Create(ctx, "bad", 16, client.CreateOptions{Manifest: []byte(`{"x":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}`)})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Seal(ctx); !errors.Is(err, client.ErrInvalid) {
		t.Fatalf("seal with a manifest past the object: %v", err)
	}
}

func init() {
	// Gets bundle NAME and checks that it holds COUNT tensors with the
	// content stream(COUNT, tensor name); says "ok COUNT".
	gpuRoles["b-reader"] = func(ctx context.Context, c *client.Client, say func(string, ...any)) error {
		n := envInt("COUNT")
		l, m, err := c.GetBundle(ctx, os.Getenv("NAME"), client.GetOptions{})
		if err != nil {
			return err
		}
		defer l.Release()
		if len(m.Tensors) != n || m.Metadata["format"] != "pt" {
			return fmt.Errorf("manifest has %d tensors and metadata %v", len(m.Tensors), m.Metadata)
		}
		data := l.Bytes()
		for _, tn := range m.Tensors {
			if tn.Begin%bundle.Alignment != 0 {
				return fmt.Errorf("tensor %s at unaligned offset %d", tn.Name, tn.Begin)
			}
			if !bytes.Equal(data[tn.Begin:tn.End], stream(uint64(n), tn.Name, int(tn.Size()))) {
				return fmt.Errorf("tensor %s differs", tn.Name)
			}
		}
		say("ok %d", len(m.Tensors))
		return nil
	}
}
