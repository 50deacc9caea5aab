package store

// The hostile-uid suite (issue 17): a daemon process admits uid 65534, and
// attackers run as that uid (util-linux setpriv, as a user would be), each
// doing its worst within bounded loops; the test checks explicit bounds on
// the daemon (descriptors, RSS, log lines) and that root's object is
// neither read nor changed, and root keeps being served. The figures go to
// docs/hardening.md, "A second hostile uid".

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// The hostile daemon's configuration: its descriptor limit and what the
// defaults make of it (fdBudget: MaxConns 2048, MaxFDs 1024, 512 per uid
// with two uids named), and two limits lowered so that the attacks that
// reach them take seconds.
const (
	hostileNoFile      = 4096
	hostileFDsPerUID   = 512
	hostileConnsPerUID = 64
	hostileObjsPerUID  = 16384
	hostileUID         = 65534
)

// hostileDaemonHelper serves a store as root at $CUDAIPC_STORE_TEST_SOCKET
// with the hostile configuration, logging at Info to stderr, until its
// standard input closes.
func hostileDaemonHelper() int {
	rl := unix.Rlimit{Cur: hostileNoFile, Max: hostileNoFile}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		fmt.Fprintln(os.Stderr, "setrlimit:", err)
		return 2
	}
	s, err := New(Config{Backend: "host", AllowUIDs: []uint32{hostileUID}, MaxConnsPerUID: hostileConnsPerUID,
		MaxObjectsPerUID: hostileObjsPerUID, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil))})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer s.Close()
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	if err := s.ListenAndServe(ctx, os.Getenv("CUDAIPC_STORE_TEST_SOCKET")); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// hconn is an attacker's raw connection; every receive is bounded.
type hconn struct {
	c  *protocol.Conn
	uc *net.UnixConn
	id uint64
}

func hdial(path string) (*hconn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, err
	}
	c := protocol.NewConn(uc)
	if _, err := protocol.ClientHello(ctx, c, "hostile"); err != nil {
		c.Close()
		return nil, err
	}
	return &hconn{c: c, uc: uc, id: 1}, nil
}

// do sends r with files and returns its response (events are skipped).
func (h *hconn) do(r *storev1.Request, files ...*os.File) (*storev1.Response, []*os.File, error) {
	h.id++
	r.Id = h.id
	if err := h.c.Send(r, files...); err != nil {
		return nil, nil, err
	}
	h.uc.SetReadDeadline(time.Now().Add(20 * time.Second))
	for {
		var resp storev1.Response
		got, err := h.c.Recv(&resp)
		if err != nil {
			return nil, nil, err
		}
		if resp.GetId() == h.id {
			return &resp, got, nil
		}
		protocol.CloseFiles(got)
	}
}

// limitOf describes a LIMIT response, "" for other responses.
func limitOf(resp *storev1.Response) string {
	if e := resp.GetError(); e.GetCode() == storev1.Error_LIMIT {
		return e.GetLimit().String() + ": " + e.GetMessage()
	}
	return ""
}

// hostileHelper runs one attack ($HOSTILE_ATTACK) as uid 65534, prints a
// JSON report, then holds what it made until its standard input closes (or
// says "next" for the attacks in two steps).
func hostileHelper() int {
	if os.Getuid() != hostileUID {
		fmt.Fprintf(os.Stderr, "hostile helper runs as uid %d, not %d\n", os.Getuid(), hostileUID)
		return 2
	}
	path := os.Getenv("CUDAIPC_STORE_TEST_SOCKET")
	in := bufio.NewScanner(os.Stdin)
	rep := map[string]any{}
	say := func() {
		json.NewEncoder(os.Stdout).Encode(rep)
	}
	deadline := time.Now().Add(60 * time.Second)
	var held []*hconn
	defer func() {
		for _, h := range held {
			h.c.Close()
		}
	}()
	switch a := os.Getenv("HOSTILE_ATTACK"); a {
	case "fds":
		// Registrations of a GPU the host daemon does not have, then
		// descriptors staged on connection after connection, then shared
		// drafts (an arena of their own, two descriptors each).
		h, err := hdial(path)
		if err != nil {
			rep["err"] = err.Error()
			break
		}
		held = append(held, h)
		fd, _ := unix.MemfdCreate("piece", unix.MFD_CLOEXEC)
		piece := os.NewFile(uintptr(fd), "piece")
		u, _ := cudaipc.ParseUUID(testGPU)
		region, _ := (&cudaipc.Region{Version: cudaipc.RegionVersion, Kind: cudaipc.KindVMMFD, AllocationID: cudaipc.NewAllocationID(),
			Size: 1 << 20, AllocSize: 2 << 20, Device: u, ExporterPID: 42, PIDNamespace: 4026531836,
			BootID: cudaipc.BootID{1}, ExporterBase: 0x7f0000000000}).MarshalBinary()
		resp, _, err := h.do(&storev1.Request{Body: &storev1.Request_Register{Register: &storev1.RegisterRequest{
			Name: "gpu", Size: 1 << 20, Device: testGPU, Region: region, Files: 1}}}, piece)
		if err == nil {
			rep["register"] = resp.GetError().GetCode().String() + ": " + resp.GetError().GetMessage()
		}
		staged, stageLimit := 0, ""
		for i := 0; i < hostileConnsPerUID-4 && stageLimit == "" && time.Now().Before(deadline); i++ {
			h, err := hdial(path)
			if err != nil {
				break
			}
			held = append(held, h)
			for j := 0; j < maxStagedPerConn/protocol.MaxFiles && stageLimit == ""; j++ {
				files := make([]*os.File, protocol.MaxFiles)
				for k := range files {
					files[k] = piece
				}
				resp, _, err := h.do(&storev1.Request{Body: &storev1.Request_StageFiles{StageFiles: &storev1.StageFilesRequest{}}}, files...)
				if err != nil {
					break
				}
				if stageLimit = limitOf(resp); stageLimit == "" {
					staged += len(files)
				}
			}
		}
		rep["staged"], rep["stage_limit"] = staged, stageLimit
		shared, sharedLimit := 0, ""
		for i := 0; i < 4096 && sharedLimit == "" && time.Now().Before(deadline); i++ {
			resp, files, err := h.do(&storev1.Request{Body: &storev1.Request_Create{Create: &storev1.CreateRequest{
				Name: "s" + strconv.Itoa(i), Size: 1, Shared: true}}})
			if err != nil {
				break
			}
			protocol.CloseFiles(files)
			if sharedLimit = limitOf(resp); sharedLimit == "" && resp.GetError() == nil {
				shared++
			}
		}
		rep["shared_drafts"], rep["shared_limit"] = shared, sharedLimit
	case "drafts":
		// One-byte private drafts on as many connections as it takes,
		// 64 requests in flight at a time.
		made, limit := 0, ""
		for i := 0; i < hostileConnsPerUID-4 && limit == "" && time.Now().Before(deadline); i++ {
			h, err := hdial(path)
			if err != nil {
				rep["err"] = err.Error()
				break
			}
			held = append(held, h)
			for batch := 0; batch < DefaultMaxObjectsPerClient/64 && limit == ""; batch++ {
				first := h.id + 1
				for k := range 64 {
					h.id++
					h.c.Send(&storev1.Request{Id: h.id, Body: &storev1.Request_Create{Create: &storev1.CreateRequest{
						Name: fmt.Sprintf("d%d-%d-%d", i, batch, k), Size: 1}}})
				}
				h.uc.SetReadDeadline(time.Now().Add(20 * time.Second))
				for id := first; id <= h.id; id++ {
					var resp storev1.Response
					files, err := h.c.Recv(&resp)
					if err != nil {
						limit = "recv: " + err.Error()
						break
					}
					protocol.CloseFiles(files)
					if l := limitOf(&resp); l != "" {
						if limit == "" || strings.HasPrefix(limit, storev1.Error_OBJECTS_PER_CONNECTION.String()) {
							limit = l
						}
					} else if resp.GetError() == nil {
						made++
					}
				}
				if strings.HasPrefix(limit, storev1.Error_OBJECTS_PER_CONNECTION.String()) {
					limit = "" // next connection
					break
				}
			}
		}
		rep["drafts"], rep["limit"] = made, limit
	case "logs":
		// Bad packets on connection after connection for 6 s.
		end := time.Now().Add(6 * time.Second)
		n := 0
		for ; n < 20000 && time.Now().Before(end); n++ {
			h, err := hdial(path)
			if err != nil {
				continue
			}
			h.uc.Write([]byte{0xff, 0xff, 0xff})
			h.uc.SetReadDeadline(time.Now().Add(5 * time.Second))
			var b [64]byte
			h.uc.Read(b[:])
			h.c.Close()
		}
		rep["bad_packets"] = n
	case "conns":
		// Connections until the daemon says no: the words must be right.
		for i := 0; i < 4*hostileConnsPerUID && time.Now().Before(deadline); i++ {
			h, err := hdial(path)
			if err != nil {
				rep["refused"] = err.Error()
				var ce *protocol.CodeError
				if errors.As(err, &ce) {
					rep["limit"] = ce.Limit.String()
				}
				break
			}
			held = append(held, h)
		}
		rep["conns"] = len(held)
	case "subscribe":
		h, err := hdial(path)
		if err != nil {
			rep["err"] = err.Error()
			break
		}
		held = append(held, h)
		if _, _, err := h.do(&storev1.Request{Body: &storev1.Request_Subscribe{Subscribe: &storev1.SubscribeRequest{}}}); err != nil {
			rep["err"] = err.Error()
			break
		}
		fmt.Println("ready")
		var seen []string
		end := time.Now().Add(20 * time.Second)
		for time.Now().Before(end) {
			h.uc.SetReadDeadline(end)
			var resp storev1.Response
			files, err := h.c.Recv(&resp)
			if err != nil {
				break
			}
			protocol.CloseFiles(files)
			if ev := resp.GetEvent(); ev != nil {
				seen = append(seen, ev.GetKind().String()+":"+ev.GetName())
				if ev.GetName() == "0:marker" {
					break
				}
			}
		}
		rep["events"] = seen
	case "sealed":
		// A shared object, sealed while still mapped writable.
		h, err := hdial(path)
		if err != nil {
			rep["err"] = err.Error()
			break
		}
		held = append(held, h)
		resp, files, err := h.do(&storev1.Request{Body: &storev1.Request_Create{Create: &storev1.CreateRequest{Name: "hs", Size: 8192, Shared: true}}})
		if err != nil || resp.GetError() != nil || len(files) != 1 {
			rep["err"] = fmt.Sprint(err, resp.GetError())
			break
		}
		p := resp.GetCreate().GetPlacement()
		m, err := unix.Mmap(int(files[0].Fd()), 0, int(p.GetArenaSize()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			rep["err"] = err.Error()
			break
		}
		obj := m[p.GetOffset() : p.GetOffset()+8192]
		copy(obj, bytes.Repeat([]byte("sealed!!"), 1024))
		if resp, _, err := h.do(&storev1.Request{Body: &storev1.Request_Seal{Seal: &storev1.SealRequest{Name: "hs"}}}); err != nil || resp.GetError() != nil {
			rep["err"] = fmt.Sprint("seal: ", err, resp.GetError())
			break
		}
		_, err = unix.Mmap(int(files[0].Fd()), 0, int(p.GetArenaSize()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		rep["remap_after_seal"] = fmt.Sprint(err)
		_, err = files[0].WriteAt([]byte("x"), int64(p.GetOffset()))
		rep["write_after_seal"] = fmt.Sprint(err)
		sum := sha256.Sum256(obj)
		rep["sha256"] = hex.EncodeToString(sum[:])
		say()
		in.Scan() // "next": unmap
		unix.Munmap(m)
		_, err = unix.Mmap(int(files[0].Fd()), 0, int(p.GetArenaSize()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		rep = map[string]any{"remap_after_unmap": fmt.Sprint(err)}
	case "root":
		// Everything a user can try on root's private object.
		h, err := hdial(path)
		if err != nil {
			rep["err"] = err.Error()
			break
		}
		held = append(held, h)
		try := func(key string, r *storev1.Request) {
			resp, files, err := h.do(r)
			protocol.CloseFiles(files)
			if err != nil {
				rep[key] = err.Error()
				return
			}
			rep[key] = resp.GetError().GetCode().String()
		}
		try("get", &storev1.Request{Body: &storev1.Request_Get{Get: &storev1.GetRequest{Name: "0:root-secret"}}})
		try("stat", &storev1.Request{Body: &storev1.Request_Stat{Stat: &storev1.StatRequest{Name: "0:root-secret"}}})
		try("delete", &storev1.Request{Body: &storev1.Request_Delete{Delete: &storev1.DeleteRequest{Name: "0:root-secret"}}})
		try("create", &storev1.Request{Body: &storev1.Request_Create{Create: &storev1.CreateRequest{Name: "0:root-secret", Size: 1}}})
		try("seal", &storev1.Request{Body: &storev1.Request_Seal{Seal: &storev1.SealRequest{Name: "0:root-secret"}}})
		try("abort", &storev1.Request{Body: &storev1.Request_Abort{Abort: &storev1.AbortRequest{Name: "0:root-secret"}}})
		resp, _, err := h.do(&storev1.Request{Body: &storev1.Request_List{List: &storev1.ListRequest{}}})
		if err == nil {
			var names []string
			for _, o := range resp.GetList().GetObjects() {
				names = append(names, o.GetName())
			}
			rep["list"] = names
		}
	default:
		fmt.Fprintf(os.Stderr, "unknown attack %q\n", a)
		return 2
	}
	say()
	for in.Scan() { // hold until told to go
	}
	return 0
}

// hostileDaemon is the daemon process of the suite.
type hostileDaemon struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	path  string
	log   testutil.SyncBuffer
}

func (d *hostileDaemon) Write(p []byte) (int, error) { return d.log.Write(p) }

func (d *hostileDaemon) logs() string { return d.log.String() }

// fds and rssKiB read the daemon's descriptor count and resident set.
func (d *hostileDaemon) fds(t *testing.T) int {
	l, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", d.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(l)
}

func (d *hostileDaemon) rssKiB(t *testing.T) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", d.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			n, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			return n
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

// attacker is one hostile helper process.
type attacker struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Scanner
}

func (a *attacker) line(t *testing.T) string {
	t.Helper()
	lines := make(chan string, 1)
	go func() {
		if a.out.Scan() {
			lines <- a.out.Text()
		}
		close(lines)
	}()
	select {
	case l, ok := <-lines:
		if !ok {
			t.Fatalf("the attacker ended without a report")
		}
		return l
	case <-time.After(3 * time.Minute):
		t.Fatal("the attacker did not report within 3 minutes")
	}
	return ""
}

func (a *attacker) report(t *testing.T) map[string]any {
	t.Helper()
	var rep map[string]any
	if err := json.Unmarshal([]byte(a.line(t)), &rep); err != nil {
		t.Fatal(err)
	}
	if e, ok := rep["err"]; ok {
		t.Fatalf("attacker: %v", e)
	}
	return rep
}

func (a *attacker) stop() {
	if a.cmd.ProcessState != nil {
		return
	}
	a.stdin.Close()
	done := make(chan struct{})
	go func() { a.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		a.cmd.Process.Kill()
		<-done
	}
}

func TestHostileUID(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the hostile-uid suite needs root: it runs attackers as uid 65534 with setpriv (CI runs it as root)")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Skip("the hostile-uid suite needs setpriv (util-linux) to run attackers as uid 65534")
	}
	// A copy of this test binary that uid 65534 may run, and a socket
	// directory it may reach.
	dir, err := os.MkdirTemp("", "cudaipc-hostile-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(dir, "store.test")
	bin, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "store.sock")

	d := &hostileDaemon{path: path}
	d.cmd = exec.Command(exe, "-test.run=^$")
	d.cmd.Env = append(os.Environ(), helperEnv+"=hostile-daemon", "CUDAIPC_STORE_TEST_SOCKET="+path)
	d.cmd.Stderr = d
	if d.stdin, err = d.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.stdin.Close()
		done := make(chan struct{})
		go func() { d.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			d.cmd.Process.Kill()
			<-done
		}
	})
	testutil.Eventually(t, testutil.Wait, func() error {
		_, err := os.Stat(path)
		return err
	})

	attack := func(name string) *attacker {
		t.Helper()
		cmd := exec.Command(setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", exe, "-test.run=^$")
		cmd.Env = append(os.Environ(), helperEnv+"=hostile", "HOSTILE_ATTACK="+name, "CUDAIPC_STORE_TEST_SOCKET="+path)
		cmd.Stderr = os.Stderr
		a := &attacker{cmd: cmd}
		var err error
		if a.stdin, err = cmd.StdinPipe(); err != nil {
			t.Fatal(err)
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		a.out = bufio.NewScanner(out)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(a.stop)
		return a
	}

	// Root's private object, and a check that root is still served and
	// its bytes are untouched.
	root := dialRawTo(t, path, false)
	root.uc.SetDeadline(time.Now().Add(10 * time.Minute))
	secret := root.put("root-secret", 1<<20, false)
	rootWorks := func(when string) {
		t.Helper()
		t0 := time.Now()
		name := "root-" + strconv.FormatInt(t0.UnixNano(), 36)
		root.put(name, 4096, false)
		resp, files := root.do(req(&storev1.GetRequest{Name: "root-secret"}))
		wantCode(t, resp, storev1.Error_OK)
		if got := root.mapping(resp.GetGet().GetPlacement(), files); !bytes.Equal(got, secret) {
			t.Fatalf("%s: root's object changed", when)
		}
		resp, _ = root.do(req(&storev1.ReleaseRequest{LeaseId: resp.GetGet().GetLeaseId()}))
		wantCode(t, resp, storev1.Error_OK)
		resp, _ = root.do(req(&storev1.DeleteRequest{Name: name}))
		wantCode(t, resp, storev1.Error_OK)
		resp, _ = root.do(req(&storev1.ListRequest{}))
		wantCode(t, resp, storev1.Error_OK)
		t.Logf("%s: root's put+get+release+delete+ls in %v", when, time.Since(t0))
	}
	baseFDs, baseRSS := d.fds(t), d.rssKiB(t)
	t.Logf("daemon at rest: %d fds, VmRSS %d KiB", baseFDs, baseRSS)

	raceFactor := 1
	if testutil.RaceEnabled {
		raceFactor = 4 // the race detector's shadow memory
	}

	t.Run("descriptors", func(t *testing.T) {
		a := attack("fds")
		defer a.stop()
		rep := a.report(t)
		fds := d.fds(t)
		t.Logf("report %v; daemon fds %d", rep, fds)
		// Bound: the uid's descriptor budget, its connections, and what the
		// daemon held at rest.
		if bound := hostileFDsPerUID + hostileConnsPerUID + baseFDs + 16; fds > bound {
			t.Errorf("the daemon holds %d descriptors, bound %d", fds, bound)
		}
		if r, _ := rep["register"].(string); !strings.HasPrefix(r, storev1.Error_INVALID.String()) || !strings.Contains(r, "no GPU backend") {
			t.Errorf("a GPU registration on a host-only daemon: %v, want INVALID", rep["register"])
		}
		for _, k := range []string{"stage_limit", "shared_limit"} {
			if l, _ := rep[k].(string); !strings.HasPrefix(l, storev1.Error_DESCRIPTORS_PER_UID.String()) || !strings.Contains(l, "max-fds-per-uid setting") {
				t.Errorf("%s: %q, want DESCRIPTORS_PER_UID naming max-fds-per-uid", k, l)
			}
		}
		rootWorks("uid 65534 at its descriptor limit")
		a.stop()
		testutil.Eventually(t, testutil.Wait, func() error {
			if n := d.fds(t); n > baseFDs+4 {
				return fmt.Errorf("%d descriptors after the attacker left, %d at rest", n, baseFDs)
			}
			return nil
		})
	})

	t.Run("drafts", func(t *testing.T) {
		a := attack("drafts")
		defer a.stop()
		rep := a.report(t)
		rss := d.rssKiB(t)
		drafts := int(rep["drafts"].(float64))
		t.Logf("%d drafts; limit %v; daemon VmRSS %d KiB (%d at rest), %d bytes a draft", drafts, rep["limit"], rss, baseRSS, (rss-baseRSS)*1024/max(drafts, 1))
		if drafts > hostileObjsPerUID {
			t.Errorf("%d drafts made, bound %d", drafts, hostileObjsPerUID)
		}
		if l, _ := rep["limit"].(string); !strings.HasPrefix(l, storev1.Error_OBJECTS_PER_UID.String()) || !strings.Contains(l, "max-objects-per-uid setting") {
			t.Errorf("limit %q, want OBJECTS_PER_UID naming max-objects-per-uid", l)
		}
		// Bound: 4 KiB a draft beyond the daemon at rest, and 64 MiB.
		if bound := (baseRSS + hostileObjsPerUID*4 + 64<<10) * raceFactor; rss > bound {
			t.Errorf("daemon VmRSS %d KiB with uid 65534's drafts, bound %d KiB", rss, bound)
		}
		rootWorks("uid 65534 at its object limit")
		a.stop()
	})

	t.Run("log flood", func(t *testing.T) {
		before := len(d.logs())
		t0 := time.Now()
		a := attack("logs")
		defer a.stop()
		rep := a.report(t)
		elapsed := time.Since(t0)
		a.stop()
		lines := strings.Count(d.logs()[before:], "uid=65534")
		perMinute := float64(lines) / elapsed.Minutes()
		t.Logf("%v bad packets in %v: %d log lines about uid 65534 (%.0f a minute)", rep["bad_packets"], elapsed, lines, perMinute)
		// Bound: the burst and one a second, plus a line per connection
		// cleanup the limiter also lets through.
		if bound := clientLogBurst + int(elapsed/clientLogEvery) + 2; lines > bound {
			t.Errorf("%d log lines in %v, bound %d", lines, elapsed, bound)
		}
		if !strings.Contains(d.logs()[before:], "suppressed=") {
			t.Error("no line says how many were held back")
		}
	})

	t.Run("connections", func(t *testing.T) {
		a := attack("conns")
		defer a.stop()
		rep := a.report(t)
		t.Logf("report %v", rep)
		if rep["conns"] != float64(hostileConnsPerUID) {
			t.Errorf("%v connections admitted, want %d", rep["conns"], hostileConnsPerUID)
		}
		msg, _ := rep["refused"].(string)
		if rep["limit"] != storev1.Error_CONNECTIONS_PER_UID.String() || !strings.Contains(msg, "max-conns-per-uid setting") || strings.Contains(msg, "admitted") {
			t.Errorf("at the limit: %v %q", rep["limit"], msg)
		}
		rootWorks("uid 65534 at its connection limit")
		a.stop()
	})

	t.Run("subscribe", func(t *testing.T) {
		a := attack("subscribe")
		defer a.stop()
		if l := a.line(t); l != "ready" {
			t.Fatalf("subscriber: %q", l)
		}
		resp, files := root.do(req(&storev1.CreateRequest{Name: "secret-draft", Size: 10, Shared: true}))
		wantCode(t, resp, storev1.Error_OK)
		root.mapping(resp.GetCreate().GetPlacement(), files)
		resp, _ = root.do(req(&storev1.AbortRequest{Name: "secret-draft"}))
		wantCode(t, resp, storev1.Error_OK)
		root.put("marker", 10, true)
		rep := a.report(t)
		events := fmt.Sprint(rep["events"])
		if strings.Contains(events, "secret-draft") || !strings.Contains(events, "SEALED:0:marker") {
			t.Errorf("uid 65534 heard %s; want the marker and not root's aborted draft", events)
		}
		a.stop()
	})

	t.Run("sealed object", func(t *testing.T) {
		a := attack("sealed")
		defer a.stop()
		rep := a.report(t)
		for _, k := range []string{"remap_after_seal", "write_after_seal"} {
			if !strings.Contains(fmt.Sprint(rep[k]), "operation not permitted") {
				t.Errorf("%s: %v, want EPERM", k, rep[k])
			}
		}
		in, c := root.stat("65534:hs")
		if c != storev1.Error_OK || !in.GetCreatorCanWrite() {
			t.Fatalf("stat while its creator maps it writable: %v, creator_can_write %v", c, in.GetCreatorCanWrite())
		}
		fmt.Fprintln(a.stdin, "next")
		rep = a.report(t)
		if !strings.Contains(fmt.Sprint(rep["remap_after_unmap"]), "operation not permitted") {
			t.Errorf("a writable mapping after the creator unmapped: %v, want EPERM", rep["remap_after_unmap"])
		}
		in, _ = root.stat("65534:hs")
		if in.GetCreatorCanWrite() {
			t.Error("stat says the creator can write after it unmapped")
		}
		resp, files := root.do(req(&storev1.GetRequest{Name: "65534:hs"}))
		wantCode(t, resp, storev1.Error_OK)
		if got := root.mapping(resp.GetGet().GetPlacement(), files); !bytes.Equal(got, bytes.Repeat([]byte("sealed!!"), 1024)) {
			t.Error("root reads other bytes than were sealed")
		}
		a.stop()
	})

	t.Run("root's object", func(t *testing.T) {
		a := attack("root")
		defer a.stop()
		rep := a.report(t)
		want := map[string]string{"get": "TIMEOUT", "stat": "NOT_FOUND", "delete": "NOT_FOUND", "create": "PERMISSION", "seal": "NOT_FOUND", "abort": "NOT_FOUND"}
		for k, v := range want {
			if rep[k] != v {
				t.Errorf("uid 65534's %s of root's private object: %v, want %s", k, rep[k], v)
			}
		}
		if l := fmt.Sprint(rep["list"]); strings.Contains(l, "root-") {
			t.Errorf("uid 65534 lists %s", l)
		}
		a.stop()
		rootWorks("after every attack")
	})
}
