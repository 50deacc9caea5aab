package kv_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/kv"
)

// poolCmd is a command of the pooluser role: an operation on the pool
// Pool with the keys poolKeys(Seed, From+N, 32)[From:].
type poolCmd struct {
	Op       string `json:"op"`
	Pool     string `json:"pool,omitempty"`
	Shared   bool   `json:"shared,omitempty"`
	Capacity int64  `json:"capacity,omitempty"`
	Seed     uint64 `json:"seed,omitempty"`
	From     int    `json:"from,omitempty"`
	N        int    `json:"n,omitempty"`
	// Desc, for a put: the source space's description (text); empty: the
	// role's own space.
	Desc string `json:"desc,omitempty"`
}

// poolReply is the pooluser role's answer: the class of its error, a
// count, the checksum of blocks got, or names listed.
type poolReply struct {
	Err   string   `json:"err,omitempty"`
	N     int      `json:"n,omitempty"`
	Sum   string   `json:"sum,omitempty"`
	Names []string `json:"names,omitempty"`
	Desc  string   `json:"desc,omitempty"`
}

// Shape of the pooluser role's spaces: one layer, block-major ("host"),
// blocks of 2*poolUserBytes bytes.
const (
	poolUserBlocks = 16
	poolUserBytes  = 64
)

func errClass(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, client.ErrNotFound):
		return "notfound"
	case errors.Is(err, client.ErrPermission):
		return "permission"
	case errors.Is(err, client.ErrLimit):
		return "limit"
	case errors.Is(err, client.ErrStoreFull):
		return "storefull"
	case errors.Is(err, client.ErrExists):
		return "exists"
	}
	return err.Error()
}

// rolePoolUser registers a host space SPACE (seed SEED, poolUserBlocks
// blocks, block b's bytes testutil.RandomBytes(SEED, ...)[b*2*poolUserBytes:]),
// says its description, then runs poolCmds until its input ends.
func rolePoolUser(p *testutil.Peer) error {
	ctx := context.Background()
	c, err := client.Dial(ctx, os.Getenv("SOCK"))
	if err != nil {
		return err
	}
	defer c.Close()
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	l, sizes := testLayout("host", 1, poolUserBlocks, poolUserBytes)
	h, err := kv.AllocHost(sizes[0])
	if err != nil {
		return err
	}
	defer h.Close()
	copy(h.Bytes(), testutil.RandomBytes(seed, int(sizes[0])))
	sp, err := kv.Register(ctx, c, os.Getenv("SPACE"), &kv.Local{Layout: l, Memory: []kv.Memory{h.Memory()}}, client.RegisterOptions{Shared: os.Getenv("SHARED") == "1"})
	if err != nil {
		return err
	}
	text, _ := sp.Desc().MarshalText()
	if err := p.Send(poolReply{Desc: string(text)}); err != nil {
		return err
	}
	for {
		var cmd poolCmd
		if err := p.Recv(&cmd); err != nil {
			return nil
		}
		keys := poolKeys(cmd.Seed, cmd.From+cmd.N, 32)[cmd.From:]
		ids := make([]int, cmd.N)
		for i := range ids {
			ids[i] = (cmd.From + i) % poolUserBlocks
		}
		var r poolReply
		switch cmd.Op {
		case "create":
			_, err := c.CreatePool(ctx, cmd.Pool, client.PoolConfig{BlockBytes: 2 * poolUserBytes, KeyBytes: 32, Capacity: cmd.Capacity, Shared: cmd.Shared})
			r.Err = errClass(err)
		case "put":
			var pool *kv.Pool
			if pool, err = kv.OpenPool(ctx, c, cmd.Pool); err == nil {
				src := sp.Desc()
				if cmd.Desc != "" {
					src = new(kv.Desc)
					if err := src.UnmarshalText([]byte(cmd.Desc)); err != nil {
						return err
					}
				}
				var res client.PutResult
				res, err = pool.Put(ctx, kv.PutRequest{Keys: keys, Src: src, SrcBlocks: ids})
				r.N = res.Stored
			}
			r.Err = errClass(err)
		case "lookup":
			r.N, _, err = c.LookupBlocks(ctx, cmd.Pool, keys, client.LookupOptions{})
			r.Err = errClass(err)
		case "get":
			var pool *kv.Pool
			if pool, err = kv.OpenPool(ctx, c, cmd.Pool); err == nil {
				dst := localSpace("host", 1, cmd.N, poolUserBytes, 1)
				dstIDs := make([]int, cmd.N)
				for i := range dstIDs {
					dstIDs[i] = i
				}
				var t *kv.Transfer
				if t, err = pool.Get(ctx, kv.GetRequest{Keys: keys, Dst: dst, DstBlocks: dstIDs}); err == nil {
					err = t.Wait(ctx)
				}
				r.Sum = testutil.Sum(dst.Memory[0].Host)
				pool.Close()
			}
			r.Err = errClass(err)
		case "delete":
			r.N, err = c.DeleteBlocks(ctx, cmd.Pool, keys)
			r.Err = errClass(err)
		case "evict":
			r.N, err = c.EvictBlocks(ctx, cmd.Pool, 1)
			r.Err = errClass(err)
		case "deletepool":
			r.Err = errClass(c.DeletePool(ctx, cmd.Pool))
		case "list":
			var ps []client.PoolInfo
			ps, err = c.ListPools(ctx)
			for _, p := range ps {
				r.Names = append(r.Names, p.Name)
			}
			r.Err = errClass(err)
		default:
			return fmt.Errorf("unknown command %q", cmd.Op)
		}
		if err := p.Send(r); err != nil {
			return err
		}
	}
}

// poolUser is a pooluser child.
type poolUser struct {
	*testutil.Child
	desc string
	seed uint64
}

func startPoolUser(t *testing.T, sock, space string, seed uint64, o testutil.SpawnOptions) *poolUser {
	t.Helper()
	o.Env = append(o.Env, "SOCK="+sock, "SPACE="+space, "SEED="+strconv.FormatUint(seed, 10))
	u := &poolUser{Child: testutil.SpawnWith(t, "pooluser", o), seed: seed}
	var r poolReply
	if err := u.Recv(&r); err != nil {
		t.Fatalf("pooluser: %v: %s", err, u.Stderr())
	}
	u.desc = r.Desc
	return u
}

func (u *poolUser) do(t *testing.T, cmd poolCmd) poolReply {
	t.Helper()
	if err := u.Send(cmd); err != nil {
		t.Fatal(err)
	}
	var r poolReply
	if err := u.Recv(&r); err != nil {
		t.Fatalf("pooluser %v: %v: %s", cmd, err, u.Stderr())
	}
	return r
}

// sum is the checksum a get of keys [from, from+n) of u's puts returns:
// key from+i holds block (from+i) % poolUserBlocks of u's space.
func (u *poolUser) sum(from, n int) string {
	space := testutil.RandomBytes(u.seed, poolUserBlocks*2*poolUserBytes)
	var out []byte
	for i := range n {
		b := (from + i) % poolUserBlocks
		out = append(out, space[b*2*poolUserBytes:(b+1)*2*poolUserBytes]...)
	}
	return testutil.Sum(out)
}

// otherUIDs starts a daemon admitting uids 65534 and 65533 and returns its
// socket and spawn options for children of those uids (running a copy of
// the test binary they may execute).
func otherUIDs(t *testing.T, env ...string) (sock string, uid65534, uid65533 testutil.SpawnOptions) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a child as another uid (CI runs as root)")
	}
	sock = startDaemon(t, append(env, "ALLOW_UIDS=65534 65533")...)
	exe := filepath.Join(filepath.Dir(sock), "kv.test")
	bin, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	as := func(uid uint32) testutil.SpawnOptions {
		return testutil.SpawnOptions{Exe: exe, SysProcAttr: &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}}
	}
	return sock, as(65534), as(65533)
}

// TestPoolUIDIsolation checks pools between uids: another uid's private
// pool is invisible (NOT_FOUND) to a reader, a shared one is read (lookup,
// get, list) but not written (put, delete, evict, delete of the pool:
// PERMISSION); each uid's pool names are its own; a put cannot copy from
// another uid's private space; a pool counts against its uid's quota.
func TestPoolUIDIsolation(t *testing.T) {
	// Three uids share 24 MiB: a quota of 8 MiB each.
	sock, a, b := otherUIDs(t, "CAPACITY=25165824")
	owner := startPoolUser(t, sock, "space", 21, a)
	other := startPoolUser(t, sock, "space", 22, b)
	ok := func(r poolReply) poolReply {
		t.Helper()
		if r.Err != "" {
			t.Fatalf("%+v", r)
		}
		return r
	}
	ok(owner.do(t, poolCmd{Op: "create", Pool: "p/private", Capacity: 1 << 20}))
	ok(owner.do(t, poolCmd{Op: "create", Pool: "p/shared", Capacity: 1 << 20, Shared: true}))
	for _, pool := range []string{"p/private", "p/shared"} {
		if r := ok(owner.do(t, poolCmd{Op: "put", Pool: pool, Seed: 1, N: 12})); r.N != 12 {
			t.Fatalf("owner's put into %s: %+v", pool, r)
		}
	}
	for _, c := range []struct {
		cmd  poolCmd
		want string
	}{
		{poolCmd{Op: "lookup", Pool: "65534:p/private", Seed: 1, N: 12}, "notfound"},
		{poolCmd{Op: "get", Pool: "65534:p/private", Seed: 1, N: 12}, "notfound"},
		{poolCmd{Op: "put", Pool: "65534:p/private", Seed: 2, N: 1}, "notfound"},
		{poolCmd{Op: "put", Pool: "65534:p/shared", Seed: 2, N: 1}, "permission"},
		{poolCmd{Op: "delete", Pool: "65534:p/shared", Seed: 1, N: 1}, "permission"},
		{poolCmd{Op: "evict", Pool: "65534:p/shared"}, "permission"},
		{poolCmd{Op: "deletepool", Pool: "65534:p/shared"}, "permission"},
		{poolCmd{Op: "lookup", Pool: "p/private", Seed: 1, N: 12}, "notfound"}, // its own namespace: none yet
		{poolCmd{Op: "create", Pool: "p/private", Capacity: 1 << 20}, ""},      // the same bare name, its own
		{poolCmd{Op: "put", Pool: "p/private", Seed: 3, N: 4, Desc: owner.desc}, "notfound"},
		{poolCmd{Op: "create", Pool: "p/big", Capacity: 12 << 20}, "limit"}, // past its quota
	} {
		if r := other.do(t, c.cmd); r.Err != c.want {
			t.Errorf("uid 65533 %s %s: %+v, want %q", c.cmd.Op, c.cmd.Pool, r, c.want)
		}
	}
	if r := ok(other.do(t, poolCmd{Op: "lookup", Pool: "65534:p/shared", Seed: 1, N: 12})); r.N != 12 {
		t.Errorf("uid 65533's lookup in a shared pool: %+v", r)
	}
	if r := ok(other.do(t, poolCmd{Op: "get", Pool: "65534:p/shared", Seed: 1, N: 12})); r.Sum != owner.sum(0, 12) {
		t.Errorf("uid 65533's get from a shared pool: the wrong bytes")
	}
	if r := ok(other.do(t, poolCmd{Op: "list"})); !slices.Equal(r.Names, []string{"p/private", "65534:p/shared"}) { // by qualified name
		t.Errorf("uid 65533 lists %v", r.Names)
	}
	// Root reads every pool, by its qualified name.
	c := dial(t, sock)
	if n, _, err := c.LookupBlocks(context.Background(), "65534:p/private", poolKeys(1, 12, 32), client.LookupOptions{}); n != 12 || err != nil {
		t.Errorf("root's lookup in a private pool: %d, %v", n, err)
	}
}

// The storm: stormer children put, get, look up (pinning or not), delete
// and evict blocks of one pool at random, all with the same contents per
// key (key k of stormKey holds stormBlock(k)), and check every block a get
// returns.
const (
	stormKeys  = 96
	stormBytes = 256 // a part; a block is two
)

func stormKey(k int) []byte {
	h := sha256.Sum256(binary.LittleEndian.AppendUint64([]byte("storm"), uint64(k)))
	return h[:]
}

func stormBlock(k int) []byte { return testutil.RandomBytes(uint64(5000+k), 2*stormBytes) }

// stormMsg is what a stormer says when it is done.
type stormMsg struct {
	Ops, Verified, Missing int
	Err                    string `json:",omitempty"`
}

// roleStormer runs OPS random operations (or until DEADLINE, Unix ms) on
// the pool POOL and says how many blocks it verified; any wrong byte ends
// it with the error.
func roleStormer(p *testutil.Peer) error {
	ctx := context.Background()
	c, err := client.Dial(ctx, os.Getenv("SOCK"))
	if err != nil {
		return err
	}
	defer c.Close()
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	ops, _ := strconv.Atoi(os.Getenv("OPS"))
	deadlineMs, _ := strconv.ParseInt(os.Getenv("DEADLINE"), 10, 64)
	deadline := time.UnixMilli(deadlineMs)
	l, sizes := testLayout("host", 1, stormKeys, stormBytes)
	h, err := kv.AllocHost(sizes[0])
	if err != nil {
		return err
	}
	defer h.Close()
	for k := range stormKeys {
		copy(h.Bytes()[k*2*stormBytes:], stormBlock(k))
	}
	sp, err := kv.Register(ctx, c, "storm/"+strconv.FormatUint(seed, 10), &kv.Local{Layout: l, Memory: []kv.Memory{h.Memory()}}, client.RegisterOptions{})
	if err != nil {
		return err
	}
	pool, err := kv.OpenPool(ctx, c, os.Getenv("POOL"))
	if err != nil {
		return err
	}
	defer pool.Close()
	r := rand.New(rand.NewPCG(seed, 7))
	pick := func() ([][]byte, []int) {
		n := 1 + r.IntN(24)
		ks := make([][]byte, n)
		ids := make([]int, n)
		for i := range ks {
			ids[i] = r.IntN(stormKeys)
			ks[i] = stormKey(ids[i])
		}
		return ks, ids
	}
	var m stormMsg
	dst := localSpace("host", 1, 24, stormBytes, seed)
	for ; m.Ops < ops && time.Now().Before(deadline); m.Ops++ {
		ks, ids := pick()
		switch op := r.IntN(10); {
		case op < 3:
			if _, err := pool.Put(ctx, kv.PutRequest{Keys: ks, Src: sp.Desc(), SrcBlocks: ids}); err != nil {
				return fmt.Errorf("put: %w", err)
			}
		case op < 7:
			var pin uint64
			if op == 6 {
				if _, pin, err = pool.Lookup(ctx, ks, client.LookupOptions{Pin: true, PinTimeout: 50 * time.Millisecond}); err != nil {
					return fmt.Errorf("lookup: %w", err)
				}
			}
			dstIDs := make([]int, len(ks))
			for i := range dstIDs {
				dstIDs[i] = i
			}
			t, err := pool.Get(ctx, kv.GetRequest{Keys: ks, Dst: dst, DstBlocks: dstIDs, Pin: pin})
			if err != nil {
				return fmt.Errorf("get: %w", err)
			}
			err = t.Wait(ctx)
			var be *kv.BlockError
			if err != nil && !(errors.Is(err, kv.ErrMissing) && errors.As(err, &be)) {
				return fmt.Errorf("get: %w", err)
			}
			for i, id := range ids {
				if be != nil && slices.Contains(be.Blocks, i) {
					m.Missing++
					continue
				}
				if got := dst.Memory[0].Host[i*2*stormBytes : (i+1)*2*stormBytes]; !bytes.Equal(got, stormBlock(id)) {
					m.Err = fmt.Sprintf("key %d: a get returned bytes that are not its block", id)
					return say(p, m)
				}
				m.Verified++
			}
		case op < 8:
			if _, _, err := pool.Lookup(ctx, ks, client.LookupOptions{Pin: r.IntN(2) == 0, PinTimeout: 20 * time.Millisecond}); err != nil {
				return fmt.Errorf("lookup: %w", err)
			}
		case op < 9:
			if _, err := pool.Delete(ctx, ks); err != nil {
				return fmt.Errorf("delete: %w", err)
			}
		default:
			if _, err := pool.Evict(ctx, 1+r.IntN(4)); err != nil {
				return fmt.Errorf("evict: %w", err)
			}
		}
	}
	return say(p, m)
}

// say sends m and waits for the end of the input: a child that exits at
// once may lose what it wrote to the test.
func say(p *testutil.Peer, m stormMsg) error {
	if err := p.Send(m); err != nil {
		return err
	}
	var end string
	p.Recv(&end)
	return nil
}

// TestPoolStorm runs stormers against one pool smaller than their keys
// (so that puts evict), kills some with SIGKILL midway, and checks that no
// get ever returned a wrong byte, that no pin or block being written
// outlives the storm, that the pool never holds more than its capacity,
// and that it still serves: a final get of everything present is checked.
// It is bounded: stormOps operations each, or stormTime.
func TestPoolStorm(t *testing.T) {
	const stormers, killed, stormOps, stormTime = 5, 2, 1500, 4 * time.Second
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	pool, err := kv.CreatePool(ctx, c, "storm", client.PoolConfig{BlockBytes: 2 * stormBytes, KeyBytes: 32, Capacity: 40 * 512})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	deadline := time.Now().Add(stormTime)
	var children []*testutil.Child
	for i := range stormers {
		ops := stormOps
		if i < killed {
			ops = 1 << 30 // until killed (or the deadline)
		}
		children = append(children, testutil.Spawn(t, "stormer", "SOCK="+sock, "POOL=storm", "SEED="+strconv.Itoa(100+i),
			"OPS="+strconv.Itoa(ops), "DEADLINE="+strconv.FormatInt(deadline.UnixMilli(), 10)))
	}
	// Some die mid-storm, whatever they hold (pins, puts half done).
	for i, ch := range children[:killed] {
		time.Sleep(time.Duration(150+100*i) * time.Millisecond)
		if err := ch.Wait(0); err == nil {
			t.Fatal("a stormer to kill had ended already")
		}
		syscall.Kill(ch.Pid(), syscall.SIGKILL)
	}
	total := 0
	for _, ch := range children[killed:] {
		var m stormMsg
		if err := ch.Recv(&m); err != nil {
			t.Fatalf("stormer: %v: %s", err, ch.Stderr())
		}
		if m.Err != "" {
			t.Fatal(m.Err)
		}
		if m.Verified == 0 {
			t.Errorf("a stormer verified no block in %d operations", m.Ops)
		}
		total += m.Verified
		t.Logf("stormer: %d operations, %d blocks verified, %d missing", m.Ops, m.Verified, m.Missing)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		info, err := pool.Stat(ctx)
		if err != nil {
			return err
		}
		if info.Pinned != 0 || info.Writing != 0 {
			return fmt.Errorf("after the storm: %d blocks pinned, %d being written", info.Pinned, info.Writing)
		}
		if info.Blocks > info.CapacityBlocks || info.CapacityBlocks != 40 {
			return fmt.Errorf("%d blocks in a pool of %d", info.Blocks, info.CapacityBlocks)
		}
		return nil
	})
	// Everything still present holds its block.
	keys := make([][]byte, stormKeys)
	ids := make([]int, stormKeys)
	for k := range keys {
		keys[k], ids[k] = stormKey(k), k
	}
	dst := localSpace("host", 1, stormKeys, stormBytes, 1)
	tr, err := pool.Get(ctx, kv.GetRequest{Keys: keys, Dst: dst, DstBlocks: ids})
	if err != nil {
		t.Fatal(err)
	}
	err = tr.Wait(ctx)
	var be *kv.BlockError
	if err != nil && !errors.As(err, &be) {
		t.Fatal(err)
	}
	present := 0
	for k := range stormKeys {
		if be != nil && slices.Contains(be.Blocks, k) {
			continue
		}
		present++
		if !bytes.Equal(dst.Memory[0].Host[k*2*stormBytes:(k+1)*2*stormBytes], stormBlock(k)) {
			t.Fatalf("key %d holds bytes that are not its block", k)
		}
	}
	t.Logf("storm: %d blocks verified by the stormers; %d of %d keys present after it", total, present, stormKeys)
}
