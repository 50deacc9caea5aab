package staging

import (
	"bufio"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// Populate faults in every page of a fresh mapping (a length that is no
// multiple of its step, more steps than workers) and leaves it zero.
func TestPopulate(t *testing.T) {
	page := os.Getpagesize()
	n := 2*populateStep + 5*page + 123
	// Between two inaccessible pages, so that the kernel cannot merge the
	// mapping with a neighbour, which /proc/self/smaps would then count
	// with it.
	rounded := (n + page - 1) / page * page
	full, err := unix.Mmap(-1, 0, rounded+2*page, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(full)
	if err := unix.Mprotect(full[page:page+rounded], unix.PROT_READ|unix.PROT_WRITE); err != nil {
		t.Fatal(err)
	}
	mem := full[page : page+n]
	resident := func() int { return rssPages(t, mem) }
	if k := resident(); k == (n+page-1)/page {
		t.Fatalf("a fresh mapping has all %d pages resident already", k)
	}
	Populate(mem, 2)
	if k, want := resident(), (n+page-1)/page; k != want {
		t.Fatalf("%d of %d pages resident after Populate", k, want)
	}
	for i, b := range mem {
		if b != 0 {
			t.Fatalf("byte %d is %d after Populate", i, b)
		}
	}
}

// rssPages is how many pages of mem's mapping are resident, from
// /proc/self/smaps.
func rssPages(t *testing.T, mem []byte) int {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Skip(err)
	}
	defer f.Close()
	start := fmt.Sprintf("%x-", reflect.ValueOf(mem).Pointer())
	sc := bufio.NewScanner(f)
	in := false
	for sc.Scan() {
		line := sc.Text()
		if strings.Contains(strings.Fields(line)[0], "-") && !strings.HasSuffix(strings.Fields(line)[0], ":") {
			in = strings.HasPrefix(line, start)
			continue
		}
		var kb int
		if in && strings.HasPrefix(line, "Rss:") {
			if _, err := fmt.Sscanf(line, "Rss: %d kB", &kb); err != nil {
				t.Fatal(err)
			}
			return kb * 1024 / os.Getpagesize()
		}
	}
	t.Fatalf("no mapping at %s in /proc/self/smaps", start)
	return 0
}
