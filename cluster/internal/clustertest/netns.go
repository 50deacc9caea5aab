package clustertest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
)

// Net is a test network of its own: a switch (a bridge in a network
// namespace made for the test, which also runs etcd) and a veth link from
// it to each node, each node a process in a network namespace of its own
// (started with CLONE_NEWNET), each link limited by tc where asked. No
// traffic leaves these namespaces; everything goes when the test ends
// (a node's namespace with its process, the switch's by name).
type Net struct {
	t     testing.TB
	sw    string // the switch namespace's name
	links int
	ports map[int]string // the switch's port of each linked process
}

// netPrefix is the switch's subnet, inside the test's namespaces only.
const netPrefix = "10.199.0."

// bridgeMAC is the switch's own link-layer address, set so that it never
// changes (NewNet), and the ports' addresses, which link i makes
// portMAC(i): each new port's lower than every earlier one's and than
// bridgeMAC, so that a bridge that did follow its lowest port (as one
// without an address of its own does) would change its address whenever
// the node linked last goes.
const bridgeMAC = "02:00:0a:c7:00:01"

func portMAC(i int) string {
	return fmt.Sprintf("02:00:00:00:%02x:%02x", (0xffff-i)>>8, (0xffff-i)&0xff)
}

// EtcdPort is etcd's client port on the switch.
const EtcdPort = 2379

// RequireNet skips the test, or fails it under etcdtest.EnvRequire=1,
// where network namespaces cannot be made (not root, or no ip/tc).
func RequireNet(t testing.TB) {
	t.Helper()
	why := ""
	if os.Geteuid() != 0 {
		why = "network namespaces need root"
	} else if _, err := exec.LookPath("ip"); err != nil {
		why = "no ip command (apt-get install iproute2)"
	} else if _, err := exec.LookPath("tc"); err != nil {
		why = "no tc command (apt-get install iproute2)"
	}
	if why == "" {
		return
	}
	if os.Getenv(etcdtest.EnvRequire) == "1" {
		t.Fatal(why)
	}
	t.Skip(why)
}

// NewNet makes the switch namespace with its bridge at 10.199.0.1.
func NewNet(t testing.TB) *Net {
	t.Helper()
	RequireNet(t)
	sweepNetns()
	n := &Net{t: t, sw: fmt.Sprintf("cxt-%d-%d-sw", os.Getpid(), time.Now().UnixNano()%1e6)}
	n.run("ip", "netns", "add", n.sw)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", n.sw).Run() })
	n.run("ip", "-n", n.sw, "link", "set", "lo", "up")
	// The bridge gets an address of its own. Without one, Linux gives a
	// bridge the lowest address among its ports and changes it when that
	// port leaves: a node killed with its namespace takes its port, and
	// with it possibly the address every other node has cached for
	// 10.199.0.1 (etcd). Nothing tells them (no gratuitous ARP), so their
	// etcd traffic went to a MAC no one has until the neighbour entry
	// expired or etcd happened to send to them first: 30 s and more.
	n.run("ip", "-n", n.sw, "link", "add", "br0", "address", bridgeMAC, "type", "bridge")
	n.run("ip", "-n", n.sw, "addr", "add", netPrefix+"1/24", "dev", "br0")
	n.run("ip", "-n", n.sw, "link", "set", "br0", "up")
	return n
}

// sweepNetns deletes switch namespaces that earlier test processes left
// (killed before their cleanup): those whose process is gone.
func sweepNetns() {
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		parts := strings.Split(e.Name(), "-")
		if len(parts) != 4 || parts[0] != "cxt" || parts[3] != "sw" {
			continue
		}
		if pid, err := strconv.Atoi(parts[1]); err == nil {
			if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); os.IsNotExist(err) {
				_ = exec.Command("ip", "netns", "del", e.Name()).Run()
			}
		}
	}
}

func (n *Net) run(args ...string) {
	n.t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		n.t.Fatalf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// NewNetnsAttr returns the SysProcAttr of a node process in a network
// namespace of its own (killed with its parent).
func NewNetnsAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Pdeathsig: syscall.SIGKILL}
}

// Link joins the network namespace of process pid to the switch: eth0
// there, with the returned address, and its end on the bridge. rate, if
// not "", limits the link both ways with a token bucket (tc tbf, e.g.
// "200mbit"): the node's sending at eth0, its receiving at the switch's
// end.
func (n *Net) Link(pid int, rate string) (ip string) {
	n.t.Helper()
	n.links++
	i := n.links
	ip = netPrefix + strconv.Itoa(10+i)
	port := "p" + strconv.Itoa(i)
	if n.ports == nil {
		n.ports = map[int]string{}
	}
	n.ports[pid] = port
	ns := "/proc/" + strconv.Itoa(pid) + "/ns/net"
	n.run("ip", "-n", n.sw, "link", "add", port, "address", portMAC(i), "type", "veth", "peer", "name", "eth0", "netns", strconv.Itoa(pid))
	n.run("ip", "-n", n.sw, "link", "set", port, "master", "br0", "up")
	in := func(args ...string) { n.run(append([]string{"nsenter", "--net=" + ns}, args...)...) }
	in("ip", "link", "set", "lo", "up")
	in("ip", "addr", "add", ip+"/24", "dev", "eth0")
	in("ip", "link", "set", "eth0", "up")
	in("ip", "link", "set", "eth0", "mtu", strconv.Itoa(LinkMTU))
	n.run("ip", "-n", n.sw, "link", "set", port, "mtu", strconv.Itoa(LinkMTU))
	defer n.waitUp(ns)
	if rate != "" {
		shape(in, "eth0", rate)
		shape(func(args ...string) { n.run(append([]string{"ip", "netns", "exec", n.sw}, args...)...) }, port, rate)
	}
	return ip
}

// Partition cuts process pid's link (Link) off: from now on it drops every
// packet, both ways (at the node's eth0 and at the switch's end), as tc's
// netem loss 100% does; where the kernel has no netem, a byte FIFO of no
// room (bfifo limit 0) drops them.
func (n *Net) Partition(pid int) {
	n.t.Helper()
	port, ok := n.ports[pid]
	if !ok {
		n.t.Fatalf("partition of process %d, which is not linked", pid)
	}
	drop := func(ns, dev string) {
		args := []string{"nsenter", "--net=" + ns, "tc", "qdisc", "replace", "dev", dev, "root"}
		if exec.Command(args[0], append(args[1:], "netem", "loss", "100%")...).Run() != nil {
			n.run(append(args, "bfifo", "limit", "0")...)
		}
	}
	drop("/proc/"+strconv.Itoa(pid)+"/ns/net", "eth0")
	drop("/run/netns/"+n.sw, port)
}

// LinkMTU is the links' MTU: jumbo frames, as on the data-centre links
// this cluster is for (RoCE uses 4096); at 1500 the TCP/IP headers alone
// take 4.6% of a link.
const LinkMTU = 9000

// shape limits what leaves dev (run runs tc in dev's namespace) to rate
// with HTB, small packets (IP length under 512: requests, acknowledgements,
// control-channel answers) ahead of bulk data, which queues up to 4 MB
// without loss. That is a host's link as its default qdisc (fq_codel)
// serves it: sparse flows first. A plain tbf with its short tail-drop
// queue modelled it badly: bulk data filled the queue and a lone control
// answer dropped there waited for TCP's probe timer (200 ms and more),
// while a long FIFO put every request behind the bulk data queued before
// it. This test kernel has htb, u32 and bfifo, not fq_codel or prio.
func shape(run func(args ...string), dev, rate string) {
	tc := func(args ...string) { run(append([]string{"tc"}, args...)...) }
	tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
	tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate, "burst", "64kb", "cburst", "64kb")
	tc("class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate", "1mbit", "ceil", rate, "prio", "0")
	tc("class", "add", "dev", dev, "parent", "1:1", "classid", "1:20", "htb", "rate", "1mbit", "ceil", rate, "prio", "1")
	tc("qdisc", "add", "dev", dev, "parent", "1:10", "bfifo", "limit", "1mb")
	tc("qdisc", "add", "dev", dev, "parent", "1:20", "bfifo", "limit", "4mb")
	// IPv4 total length (bytes 2-3 of the header) under 512.
	tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "u16", "0", "0xfe00", "at", "2", "flowid", "1:10")
}

// waitUp waits, bounded, until eth0 in the namespace at ns is up with its
// carrier (UCX refuses a device that is not running yet).
func (n *Net) waitUp(ns string) {
	n.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		out, err := exec.Command("nsenter", "--net="+ns, "ip", "-o", "link", "show", "dev", "eth0").CombinedOutput()
		if err == nil && strings.Contains(string(out), "LOWER_UP") && strings.Contains(string(out), "state UP") {
			return
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("eth0 in %s not up within 10s: %s %v", ns, out, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Sent returns the bytes process pid's namespace has sent on its eth0 (tc's
// count): how a test sees data flowing.
func (n *Net) Sent(pid int) int64 {
	n.t.Helper()
	out, err := exec.Command("nsenter", "--net=/proc/"+strconv.Itoa(pid)+"/ns/net", "tc", "-s", "qdisc", "show", "dev", "eth0").CombinedOutput()
	if err != nil {
		n.t.Fatalf("tc -s qdisc show in %d: %v: %s", pid, err, out)
	}
	_, rest, ok := strings.Cut(string(out), "Sent ")
	if !ok {
		n.t.Fatalf("tc -s qdisc show: no Sent count in %q", out)
	}
	v, err := strconv.ParseInt(strings.Fields(rest)[0], 10, 64)
	if err != nil {
		n.t.Fatalf("tc -s qdisc show: %q: %v", out, err)
	}
	return v
}

// StartEtcd runs etcd on the switch, at 10.199.0.1:EtcdPort, until the
// test ends, and returns its endpoint. Nodes wait for it themselves (it
// is not reachable from the test's own namespace).
func (n *Net) StartEtcd() string {
	n.t.Helper()
	bin := etcdtest.Require(n.t)
	dir, err := os.MkdirTemp("/dev/shm", "cudaipc-etcd-")
	if err != nil {
		dir = n.t.TempDir()
	}
	ep := fmt.Sprintf("http://%s1:%d", netPrefix, EtcdPort)
	peer := "http://127.0.0.1:2380"
	log, err := os.Create(filepath.Join(dir, "etcd.log"))
	if err != nil {
		n.t.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", n.sw, bin, "--name", "t", "--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", ep, "--advertise-client-urls", ep,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", "t="+peer,
		"--log-level", "warn")
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		n.t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	n.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			n.t.Errorf("etcd pid %d did not exit within 10s of SIGKILL", cmd.Process.Pid)
		}
		log.Close()
		if n.t.Failed() {
			b, _ := os.ReadFile(log.Name())
			n.t.Logf("etcd's log:\n%s", b)
		}
		os.RemoveAll(dir)
	})
	return ep
}
