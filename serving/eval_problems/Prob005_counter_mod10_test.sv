`timescale 1 ps/1 ps

// Stimulus generator: holds reset high for the first three rising edges so
// that both designs start from a known state, lets the counter run freely
// long enough to wrap around several times, then asserts reset at random
// moments. reset changes on the falling edge of clk so it is stable around
// every rising edge.
module stimulus_gen (
  input      clk,
  output reg reset
);

  integer seed = 5005;

  initial begin
    reset = 1'b1;
    repeat (3) @(negedge clk);
    reset = 1'b0;
    // Free run: more than three full counting cycles.
    repeat (35) @(negedge clk);
    // Reset in the middle of a count, held for two cycles.
    reset = 1'b1;
    repeat (2) @(negedge clk);
    reset = 1'b0;
    repeat (12) @(negedge clk);
    repeat (300) @(negedge clk)
      reset = (($random(seed) & 31) == 0);
    reset = 1'b0;
    repeat (12) @(negedge clk);
    #1 $finish;
  end

endmodule

module tb ();

  reg clk = 0;
  initial forever #5 clk = ~clk;

  wire       reset;
  wire [3:0] q_ref;
  wire [3:0] q_dut;

  integer errors = 0;
  integer clocks = 0;
  integer errors_q = 0;
  integer errortime_q = 0;

  stimulus_gen stim1 (
    .clk(clk),
    .reset(reset)
  );

  RefModule good1 (
    .clk(clk),
    .reset(reset),
    .q(q_ref)
  );

  TopModule top_module1 (
    .clk(clk),
    .reset(reset),
    .q(q_dut)
  );

  // Safety net against designs that hang the simulation.
  initial begin #1000000 $display("TIMEOUT"); $finish(); end

  // Bitwise match: a bit matches when it is identical (===) in both designs.
  // A bit that is x in the reference is treated as "don't care".
  wire match_q = (q_ref === (q_ref ^ q_dut ^ q_ref));

  // Outputs are sampled 1 ps after each clock edge, once both designs have
  // settled (this avoids races with blocking assignments in the design and
  // also exposes an asynchronous reset, which would act on the falling edge).
  always @(posedge clk, negedge clk) begin
    #1;
    clocks = clocks + 1;
    if (!match_q) begin
      if (errors_q == 0) errortime_q = $time;
      errors_q = errors_q + 1;
    end
    if (!match_q)
      errors = errors + 1;
  end

  // Runs on every $finish (normal end or timeout).
  final begin
    if (errors_q)
      $display("Hint: Output '%s' has %1d mismatches. First mismatch occurred at time %1d.", "q", errors_q, errortime_q);
    else
      $display("Hint: Output '%s' has no mismatches.", "q");
    $display("Hint: Total mismatched samples is %1d out of %1d samples", errors, clocks);
    $display("Simulation finished at %1d ps", $time);
    $display("Mismatches: %1d in %1d samples", errors, clocks);
  end

endmodule
