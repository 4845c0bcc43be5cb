"""More training prompts for the SmolLM2 drafter (issue 56): templates x topics, written for this
purpose, rendered in a fixed order into `drafter_prompts_more.json` (a `train` list only).

    python benchmarks/drafter_more_prompts.py [--out benchmarks/drafter_prompts_more.json]

The held-out prompts of `drafter_prompts.json` stay what they are and are never trained on: a
generated prompt is dropped when it equals a prompt of either shipped split, or when its content
words overlap a held-out prompt's by Jaccard >= 0.5 (so "the same question reworded" never
enters training; the same kind of task on another topic does, as in the shipped train split).
The kinds of task follow the shipped prompts: explanations, history, computing and code,
creative writing, messages, advice, recipes, arithmetic, comparisons, summaries, facts,
rewriting, lists, word meanings, ideas, how-to, jobs, descriptions, reasons and game rules.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "drafter_prompts_more.json"

# (template, fillers): every filler through the template, in this order.
KINDS: list[tuple[str, list[str]]] = [
    ("Explain how {} works.", [
        "a microwave oven", "a bicycle gear", "a camera", "a thermometer", "an elevator", "a hot air balloon",
        "a submarine", "a washing machine", "a battery", "a light bulb", "a telescope", "a microscope",
        "a wind turbine", "a jet engine", "a pendulum clock", "a vending machine", "a lock and key",
        "a parachute", "a solar eclipse", "the stock market", "a credit card", "a library catalog",
        "a traffic light", "a dishwasher", "a smoke detector", "a barcode scanner", "a thermostat",
        "an electric guitar", "a 3D printer", "a hydroelectric dam"]),
    ("Why do {}?", [
        "birds sing in the morning", "dogs wag their tails", "we yawn", "our ears pop on airplanes",
        "we get goosebumps", "some animals hibernate", "fireflies glow", "we dream", "tides rise and fall",
        "bread rise", "apples turn brown after cutting", "our fingers wrinkle in water", "owls hunt at night",
        "people get hiccups", "zebras have stripes", "metals feel cold", "we sneeze", "cats land on their feet",
        "deserts get cold at night", "mosquitoes bite", "flowers smell sweet", "we shiver when cold",
        "giraffes have long necks", "planes leave white trails in the sky"]),
    ("What is {} and why does it matter?", [
        "biodiversity", "inflation", "friction", "evaporation", "the ozone layer", "a carbon footprint",
        "pollination", "a healthy diet", "compound interest", "soil", "recycling", "the immune system",
        "a vaccine", "a calendar", "voting", "the scientific method", "literacy", "clean drinking water",
        "a good night's sleep", "teamwork"]),
    ("Explain {} in simple terms.", [
        "how rain forms", "what an ecosystem is", "how a seed grows into a plant", "what energy is",
        "how the stomach digests food", "what a galaxy is", "how lungs work", "what a molecule is",
        "what a fossil is", "how wind is made", "what evolution means", "how a river forms",
        "what a cell is", "how fish breathe", "what static electricity is", "how muscles grow",
        "what a comet is", "how thunder happens", "what a habitat is", "how glaciers move"]),
    ("Who was {}?", [
        "Albert Einstein", "Cleopatra", "Napoleon Bonaparte", "Mahatma Gandhi", "Abraham Lincoln",
        "Galileo Galilei", "Queen Victoria", "Charles Darwin", "Nelson Mandela", "Florence Nightingale",
        "Genghis Khan", "Wolfgang Amadeus Mozart", "Joan of Arc", "Christopher Columbus", "Ada Lovelace",
        "Thomas Edison", "Frida Kahlo", "Alexander the Great", "Jane Austen", "Martin Luther King Jr.",
        "Amelia Earhart", "Nikola Tesla", "Confucius", "William the Conqueror", "Rosa Parks"]),
    ("Tell me about {}.", [
        "the ancient Romans", "the history of the telephone", "the Aztec empire", "the invention of paper",
        "the French Revolution", "the history of the train", "ancient China", "the Titanic",
        "the Wright brothers' first flight", "the history of the radio", "the Inca people",
        "the Ottoman Empire", "the history of money", "the Cold War", "the Stone Age", "the Bronze Age",
        "the history of the airplane", "the building of the Eiffel Tower", "the gold rush in California",
        "the history of tea", "the history of the piano", "ancient Mesopotamia", "the Mayan calendar"]),
    ("What was {}?", [
        "the Black Death", "the American Revolution", "the Space Race", "the Great Depression",
        "the Ice Age", "the Age of Exploration", "the Reformation", "the Berlin Wall",
        "the Boston Tea Party", "the printing revolution", "the Hundred Years' War", "the Enlightenment",
        "the Trojan War", "the Byzantine Empire", "the Meiji Restoration"]),
    ("What is {}?", [
        "a web browser", "a computer virus", "artificial intelligence", "a spreadsheet", "a file system",
        "a compiler", "an IP address", "a router", "a server", "a smartphone app", "a cookie on a website",
        "two-factor authentication", "a programming language", "a keyboard shortcut", "a pdf file",
        "a URL", "a firewall", "a cache", "a processor", "a hard drive", "version control",
        "an API", "a bug in software", "a pixel art", "a QR code", "Bluetooth", "a modem", "a chatbot",
        "a video game engine", "a blockchain"]),
    ("Write a Python function that {}.", [
        "returns the sum of a list", "checks whether a word is a palindrome", "counts the words in a sentence",
        "finds the smallest number in a list", "returns the even numbers of a list", "converts a string to uppercase",
        "merges two lists", "returns the last element of a list", "computes the area of a circle",
        "checks whether a year is a leap year", "returns the length of the longest word in a sentence",
        "squares every number in a list", "capitalizes every word in a sentence", "counts how often a letter appears",
        "returns the nth Fibonacci number", "checks whether a list is sorted", "removes the spaces from a string",
        "returns the average of three numbers", "converts minutes to hours and minutes",
        "finds the second largest number in a list"]),
    ("How do I {} in Python?", [
        "read a CSV file", "join a list of strings", "get the current date", "generate a random number",
        "split a string into words", "loop over a dictionary", "check if a key is in a dictionary",
        "write to a text file", "handle an exception", "import a module", "make a class", "round a number",
        "reverse a list", "find the index of an item in a list", "install a package with pip",
        "format a string with a variable", "convert a string to an integer", "use a while loop"]),
    ("What is {} in programming?", [
        "a function", "a loop", "a string", "an array", "a boolean", "an object", "a class", "a bug",
        "debugging", "a library", "a syntax error", "an integer", "a return value", "a parameter",
        "a comment", "an index", "a constant", "a stack"]),
    ("Write a short poem about {}.", [
        "the moon", "a quiet river", "a rainy afternoon", "a lighthouse", "a garden in summer", "the mountains",
        "an old oak tree", "a sleeping cat", "the wind", "a summer storm", "a childhood memory", "a busy train station",
        "the sunrise", "a field of sunflowers", "the desert at night", "a butterfly", "a winter morning",
        "the sea breeze"]),
    ("Write a haiku about {}.", [
        "the ocean", "a frog in a pond", "spring rain", "a mountain lake", "cherry blossoms", "the city at dawn",
        "a snowflake", "a candle", "the summer heat", "a crow on a fence"]),
    ("Write a short story about {}.", [
        "a boy who finds a magic key", "a cat who becomes a detective", "a lonely lighthouse keeper",
        "a talking teapot", "two friends lost in a cave", "a baker who bakes a giant cake",
        "a dog who wants to fly", "a robot who makes a friend", "a girl who plants a magic seed",
        "a mouse who lives in a library", "a knight who is afraid of the dark", "a fox who learns to share",
        "a child who discovers a secret garden", "an astronaut who finds a new planet", "a shy giant",
        "a bear who opens a bakery", "a pirate who hates the sea", "a grandmother who can time travel",
        "a snowman who wants to see summer", "a little boat in a big storm"]),
    ("Write a {}.", [
        "short speech for a school graduation", "thank-you note to a neighbor who helped me move",
        "short review of a pizza restaurant", "product description for a pair of running shoes",
        "short advertisement for a bookshop", "welcome message for a new coworker",
        "product description for a wooden desk lamp", "short bio for a freelance photographer",
        "message to congratulate a friend on a new baby", "get-well-soon card for a coworker",
        "short announcement that the office will be closed on Monday", "product description for a backpack",
        "polite complaint about a late delivery", "short toast for a retirement party",
        "text message inviting friends to a board game night", "short description of a yoga class",
        "short post announcing a community clean-up day", "welcome message for a book club",
        "short note asking a roommate to do the dishes", "product description for a scented candle",
        "short menu description for a vegetable curry", "reminder email about a dentist appointment",
        "short slogan for a bike shop", "letter to a pen pal in another country",
        "short introduction of myself for a new class", "birthday message for my sister"]),
    ("How can I {}?", [
        "save time when cooking", "stop procrastinating", "learn to swim as an adult", "keep my desk tidy",
        "stay calm in traffic", "eat more vegetables", "get better at drawing", "remember names better",
        "spend less time on my phone", "be a better listener", "make my mornings less rushed",
        "stay warm in winter", "learn to type faster", "make my home more energy efficient",
        "get more exercise at work", "make a good first impression", "keep my plants from dying while on holiday",
        "write clearer emails", "read more books", "stay motivated to learn"]),
    ("Give me {}.", [
        "five tips for a long car trip", "a recipe for a simple omelette", "three ideas for a family dinner",
        "a simple workout I can do at home", "five tips for saving electricity", "a recipe for banana bread",
        "a packing list for a beach holiday", "three tips for a first day at school", "a recipe for a fruit salad",
        "five ideas for a birthday present", "a simple plan for cleaning the kitchen",
        "three easy dinner ideas for busy evenings", "a recipe for homemade lemonade",
        "five tips for taking better photos with a phone", "three ways to relax after work",
        "a short list of things to do before a flight", "a recipe for guacamole", "ideas for a picnic lunch",
        "tips for keeping a car clean", "a simple recipe for fried rice"]),
    ("How do I make {}?", [
        "a grilled cheese sandwich", "mashed potatoes", "a green salad", "hot chocolate", "scrambled eggs",
        "popcorn on the stove", "a paper boat", "a bird feeder", "iced tea", "a simple pizza at home",
        "french toast", "a kite", "homemade soap", "a cup of coffee with a french press", "oatmeal"]),
    ("What is {}?", [
        "25 percent of 80", "10 percent of 350", "7 times 8", "half of 96", "the square of 9",
        "the average of 4, 8 and 12", "one third of 27", "the cube of 3", "100 divided by 4",
        "a quarter of 60", "20 percent of 150", "the sum of the numbers from 1 to 10"]),
    ("{}", [
        "If a pizza has 8 slices and I eat 3, how many are left?",
        "A car travels 50 miles per hour. How far does it go in 4 hours?",
        "What is the area of a circle with a radius of 3 centimeters?", "How many seconds are in an hour?",
        "Solve for x: 3x - 4 = 11.", "If a book costs 12 dollars and I buy 4, how much do I pay?",
        "How do you convert kilometers to miles?", "How do you find the perimeter of a rectangle?",
        "What is the difference between a square and a rectangle?", "How do you multiply fractions?",
        "Explain what a ratio is.", "How many weeks are in a year?", "What is an even number?",
        "How do you calculate a tip of 15 percent?", "What is the volume of a cube with sides of 2 meters?",
        "Explain long division with an example.", "What is a decimal number?",
        "How do you round 3.67 to one decimal place?",
        "If I read 20 pages a day, how long will a 300-page book take?", "How many hours are in a week?"]),
    ("What is the difference between {}?", [
        "a star and a planet", "a hurricane and a tornado", "a moth and a butterfly", "a rabbit and a hare",
        "a mountain and a hill", "baking and roasting", "a city and a town", "a poem and a song",
        "a doctor and a nurse", "a dolphin and a shark", "a fruit and a vegetable", "a desert and a jungle",
        "a river and a stream", "a virus and a cold", "a museum and a gallery", "speed and velocity",
        "a noun and a verb", "an island and a peninsula", "a bee and a wasp", "a violin and a cello",
        "a laptop and a tablet", "a whale and a fish"]),
    ("Compare {}.", [
        "bicycles and cars for getting around a city", "summer and winter holidays", "paper books and e-books",
        "working from home and working in an office", "apples and oranges as snacks",
        "living alone and living with roommates",
        "the violin and the piano", "buses and trains", "learning online and learning in a classroom",
        "swimming and running as exercise", "mountains and beaches for a holiday", "handwriting and typing notes"]),
    ("Summarize {}.", [
        "the story of Snow White", "the story of the Ugly Duckling", "the story of Peter Pan",
        "the story of Pinocchio", "the plot of Alice in Wonderland", "the story of Hansel and Gretel",
        "the story of the tortoise and the hare", "the plot of The Wizard of Oz", "the story of Sleeping Beauty",
        "the story of Aladdin", "the story of Rapunzel", "the plot of Treasure Island",
        "the story of the Little Mermaid", "the plot of Robinson Crusoe", "the story of the Trojan Horse",
        "the myth of Icarus", "the story of Beauty and the Beast", "the plot of A Christmas Carol"]),
    ("{}", [
        "What is the capital of Canada?", "What is the largest desert in the world?",
        "How many planets are in the solar system?",
        "What is the largest animal on Earth?", "Who painted the Mona Lisa?", "What is the coldest place on Earth?",
        "What language is spoken in Mexico?", "What is the capital of Italy?", "How many players are on a soccer team?",
        "What is the chemical symbol for water?", "What is the largest country in the world?",
        "Who wrote Pride and Prejudice?",
        "How many hearts does an octopus have?", "What is the freezing point of water?", "Which animal is the tallest?",
        "What is the capital of Egypt?", "What is the closest star to Earth?", "Who discovered penicillin?",
        "What is the deepest ocean trench?", "How many strings does a guitar have?", "What is the currency of Japan?",
        "Which bird is the fastest?", "What is the biggest bone in the human body?", "What is the capital of Kenya?",
        "How long does it take light from the Sun to reach Earth?", "What is the most spoken language in the world?",
        "Who was the first person to walk on the Moon?", "What is the smallest planet in the solar system?"]),
    ("{}", [
        "Rewrite this sentence to sound more polite: Give me the report now.",
        "Correct the grammar in this sentence: Me and him goes to the park.",
        "Make this sentence shorter: Due to the fact that it was raining, we decided to stay inside.",
        "Rewrite this sentence in the future tense: She plays the piano.",
        "Turn this into a question: The train leaves at noon.",
        "Rewrite this sentence in a more cheerful tone: The store is closed today.",
        "Fix the spelling in this sentence: I recieved the pakage yesterday.",
        "Rewrite this in simple words: The committee reached a unanimous decision.",
        "Make this sentence more descriptive: The house was old.",
        "Rewrite this sentence in the passive voice: The chef cooked the meal.",
        "Combine these sentences into one: I was tired. I went to bed early.",
        "Rewrite this sentence so a child can understand it: Photosynthesis converts light into chemical energy.",
        "Make this email opening more formal: Hi guys, quick update.",
        "Rewrite this sentence without the word really: The movie was really long."]),
    ("{}", [
        "Name five animals that live in the ocean.", "List five vegetables that grow underground.",
        "Name three famous composers.", "List four seasons of the year and one thing about each.",
        "Name five sports played with a ball.", "List three countries in South America.",
        "Give me five words that rhyme with light.", "Name four birds that cannot fly.",
        "List five things to bring to the beach.", "Name three inventions that changed the world.",
        "List the colors of the rainbow.", "Name five kinds of trees.", "Give me five antonyms for big.",
        "List four kinds of weather.", "Name three rivers in Africa.", "List five jobs that help people.",
        "Name five farm animals.", "Give me three fun facts about the Moon.", "List five kitchen tools.",
        "Name four famous scientists.", "List the months of the year that have 31 days.",
        "Name five insects.", "List three ways to get to school."]),
    ("What does {} mean?", [
        "the word curious", "the idiom piece of cake", "the phrase hit the road", "the word generous",
        "the idiom under the weather", "the word nostalgia", "the phrase call it a day", "the word brave",
        "the idiom spill the beans", "the word sustainable", "the phrase a blessing in disguise",
        "the word ambiguous", "the word diligent", "the idiom cost an arm and a leg"]),
    ("What is {}?", [
        "a noun", "a verb", "an adverb", "a pronoun", "a simile", "an antonym", "a paragraph",
        "alliteration", "a compound word", "a preposition", "a syllable", "a homophone"]),
    ("Give me three ideas for {}.", [
        "a school project about the ocean", "a family game night", "a short story", "a garden on a small balcony",
        "a rainy Sunday", "a class party", "a healthy snack", "a new hobby", "a surprise for my mother",
        "a summer holiday at home", "a bake sale", "a team building activity", "a themed dinner party",
        "a photography project", "a short video for social media"]),
    ("{}", [
        "Is it healthy to eat eggs every day?", "Is it good to take a nap in the afternoon?",
        "Should I drink water before a meal?", "Is it better to walk or to cycle to work?",
        "Is it safe to swim right after eating?", "Should I learn to play the piano or the guitar?",
        "Is it bad to sit all day?", "Should I buy a new phone or repair my old one?",
        "Is breakfast really the most important meal?", "Is it good to listen to music while studying?"]),
    ("Tell me {}.", [
        "a joke about cats", "a joke about math", "a riddle about time", "a fun fact about frogs",
        "a joke about the weather", "a fun fact about the Sun", "a short joke for kids", "a riddle about animals",
        "a fun fact about penguins", "an interesting fact about volcanoes", "a joke about school",
        "a fun fact about trees", "a pun about food", "an interesting fact about the Moon",
        "something interesting about sharks", "a fun fact about the Eiffel Tower"]),
    ("How do I {}?", [
        "plant a tree", "clean a cast iron pan", "make a paper crane", "remove a coffee stain from a shirt",
        "iron a shirt", "grow herbs indoors", "change a light bulb", "unclog a sink", "sew on a button",
        "get rid of ants in the kitchen", "pack a suitcase efficiently", "train for a five kilometer run",
        "care for a cactus", "clean windows without streaks", "start composting at home", "jump start a car",
        "set up a fish tank", "wrap a present neatly", "make a bed neatly", "learn to juggle",
        "teach a child to ride a bike", "write a short story", "study for a math test", "plan a road trip",
        "make a good cup of coffee", "keep bread fresh longer", "care for a rabbit", "prepare for a hike"]),
    ("What does {} do?", [
        "a dentist", "a pharmacist", "a police officer", "a journalist", "a veterinarian", "an electrician",
        "a baker", "a mail carrier", "a scientist", "a lawyer", "a gardener", "an accountant",
        "a photographer", "a plumber", "a zookeeper", "a translator", "a museum curator", "a lifeguard"]),
    ("Describe {}.", [
        "a quiet beach at sunrise", "a crowded train station", "a small bakery in the morning",
        "an old castle on a hill", "a walk in the rain", "a summer fair", "a farm at harvest time",
        "a busy city street at night", "a campfire under the stars", "a calm lake in the mountains",
        "a classroom on the first day of school", "the taste of fresh strawberries", "a thunderstorm at sea",
        "a garden full of flowers", "an autumn forest", "a cozy cabin in winter", "a fishing village",
        "the sound of the ocean", "a bustling airport", "a hot summer afternoon"]),
    ("Why is {}?", [
        "recycling important", "it important to wash our hands", "exercise good for the heart",
        "the Amazon rainforest important", "it good to learn a second language", "breakfast important",
        "it important to wear sunscreen", "music good for the mind", "it important to save money",
        "kindness important", "clean air important", "it good to spend time outdoors",
        "honesty important", "it important to vote", "play important for children"]),
    ("{}", [
        "Explain the rules of badminton.", "What are the basic rules of basketball?", "How do you play checkers?",
        "Explain the rules of baseball in simple terms.", "How do you play the card game Uno?",
        "What are the rules of musical chairs?", "Explain how to play hopscotch.", "How is golf played?",
        "What are the rules of table tennis?", "How do you play Monopoly?", "Explain the rules of rugby briefly.",
        "How do you play the game Simon says?", "What are the rules of a relay race?",
        "How do you play dominoes?", "Explain how to play sudoku."]),
    # A second set, appended so that the first 675 prompts (run7's first three data files) keep
    # their places.
    ("How does {} work?", [
        "a rocket", "a car engine", "a piano", "the internet router at home", "a helicopter", "a toaster",
        "a sewing machine", "an electric car", "a water filter", "a vacuum cleaner", "a doorbell",
        "a hearing aid", "a digital clock", "a fridge magnet", "a loudspeaker", "a lighthouse lamp",
        "a rain gauge", "an escalator", "a sailboat", "a dam", "a printer", "a scale for weighing food"]),
    ("What are the benefits of {}?", [
        "drinking green tea", "learning to play chess", "keeping a diary", "yoga", "gardening",
        "volunteering", "riding a bike to work", "eating fish", "playing team sports", "learning history",
        "taking short breaks while working", "spending time with grandparents", "cooking at home",
        "learning to code", "stretching every morning", "having a pet dog", "visiting museums",
        "writing by hand", "living near a park", "getting up early"]),
    ("What are some tips for {}?", [
        "a first job interview", "learning to draw", "keeping a budget", "moving to a new home",
        "traveling with a baby", "hiking in hot weather", "studying in a noisy place", "writing a poem",
        "taking care of a cat", "running a long race", "cooking for a large group", "driving in the snow",
        "learning to ski", "giving a presentation", "keeping a small apartment tidy", "painting a room",
        "planning a wedding", "growing strawberries", "shopping for groceries on a budget", "sleeping on a plane"]),
    ("Write a poem about {}.", [
        "a grandfather's garden", "the first day of spring", "a train journey", "a red balloon",
        "a rainy window", "an old bicycle", "the night sky over the sea", "a loyal dog", "a kitchen in the morning",
        "a mountain path", "a quiet library", "a birthday candle", "the last leaf on a tree", "a harbor at dawn"]),
    ("Write a bedtime story about {}.", [
        "a little owl who cannot sleep", "a star that falls into the sea", "a bunny who is scared of the dark",
        "a cloud who wants to be a rainbow", "a sleepy bear in winter", "a tiny turtle on a big adventure",
        "a moon that loses its glow", "a kitten and a ball of yarn", "a train that travels through the night",
        "a little mouse who dreams of cheese"]),
    ("Write an email to {}.", [
        "a teacher asking for help with homework", "a landlord about a broken heater",
        "a client thanking them for their order",
        "my team about a new meeting time", "a friend I have not seen in years", "a hotel asking about a late check-in",
        "a coworker asking for feedback on a report", "a shop asking about a refund",
        "my neighbors about a street party",
        "a company asking about a job opening", "a coach saying my child will miss practice",
        "the school about a change of address"]),
    ("Explain {} to a child.", [
        "why we pay taxes", "what a map is", "how a plane stays in the air", "why we have rules", "what money is",
        "how the Internet works", "why the Moon changes shape", "what a dinosaur was", "why we recycle",
        "how a baby bird hatches", "what a country is", "why we need bees", "how a car moves",
        "why the sea has waves", "what the heart does", "why we have day and night"]),
    ("What is the history of {}?", [
        "pizza", "the bicycle helmet", "jeans", "the calendar", "ice cream", "the umbrella", "coffee",
        "the alphabet", "soccer", "the computer mouse", "the postal service", "glasses", "the violin",
        "the marathon", "the zipper", "the teddy bear", "basketball", "the lightbulb"]),
    ("What should I know before {}?", [
        "adopting a cat", "buying a used car", "starting a small business", "going on a safari",
        "learning to scuba dive", "running my first marathon", "buying a house", "getting a tattoo",
        "traveling to Japan", "starting college", "planting a lawn", "buying a laptop", "keeping chickens",
        "going camping alone", "taking a long flight"]),
    ("{}", [
        "A box holds 12 eggs. How many boxes do I need for 60 eggs?", "What is 9 times 7?",
        "If a movie starts at 7:30 and lasts 2 hours, when does it end?", "What is 144 divided by 12?",
        "How do you find the area of a triangle?", "What is the next number: 2, 4, 8, 16?",
        "How many centimeters are in a meter?", "If I walk 3 kilometers a day, how far do I walk in a week?",
        "What is a fraction?", "How do you subtract negative numbers?", "What is the value of 2 to the power of 5?",
        "If 5 friends share 40 cookies equally, how many does each get?", "What is a right angle?",
        "How many grams are in a kilogram?", "Explain what an equation is.", "What is the median of 3, 9, 4, 7 and 5?",
        "How do you convert a fraction to a percentage?", "What is 3/4 plus 1/8?",
        "A store sells pens at 2 dollars each. How much do 15 pens cost?", "How many sides does a hexagon have?"]),
    ("{}", [
        "What is the capital of Spain?", "How many teeth does an adult human have?",
        "What is the tallest building in the world?",
        "Which ocean is the smallest?", "Who invented the telephone?", "What is the main language of Argentina?",
        "How many colors are in a rainbow?", "What is the largest island in the world?", "Who wrote The Odyssey?",
        "What is the national animal of Scotland?", "How long is a marathon?", "What is the hottest planet?",
        "Where do penguins live?", "What is the capital of Germany?", "What metal is liquid at room temperature?",
        "Which continent is the largest?", "What do caterpillars turn into?", "How many keys are on a piano?",
        "What is the most common gas in the air?", "Who composed the Four Seasons?"]),
    ("{}", [
        "Suggest a name for a new bakery.", "Suggest a name for a hiking blog.",
        "What is a good name for a pet turtle?",
        "Suggest a title for a mystery novel.", "Suggest a name for a robot in a children's story.",
        "Suggest three names for a school newspaper.", "What is a good name for a band?",
        "Suggest a motto for a running club.", "Suggest a name for a flower shop.",
        "Suggest a name for a video game about space."]),
    ("What are the pros and cons of {}?", [
        "working part time", "living in a small town", "homeschooling", "online shopping", "public transport",
        "a vegetarian diet", "remote work", "owning a car in a city", "studying abroad", "video games for children",
        "solar energy", "a four-day work week", "wearing a school uniform", "traveling alone"]),
    ("Tell me {}.", [
        "a fun fact about bees", "a joke about dogs", "an interesting fact about the human heart",
        "a fun fact about the Amazon river", "a riddle about numbers", "a joke about pirates",
        "a fun fact about cheetahs", "something surprising about bananas", "an interesting fact about Mars",
        "a knock-knock joke", "a fun fact about rainbows", "a tongue-twister about snakes"]),
    ("Describe {}.", [
        "a medieval marketplace", "a spaceship control room", "a rainy night in a big city",
        "a birthday party for a child",
        "a desert at noon", "a winter holiday market", "an underwater coral reef", "a cottage by a river",
        "a football stadium before a match", "a train ride through the countryside", "a bakery window at Christmas",
        "a playground on a sunny day", "a foggy morning by the sea", "a jungle at night"]),
    ("What skills does {} need?", [
        "a good nurse", "a pilot", "a software developer", "a chef", "a team leader", "a writer",
        "a carpenter", "a soccer coach", "a salesperson", "a scientist", "a musician", "a firefighter"]),
]


def content_words(text: str) -> set[str]:
    stop = {"a", "an", "the", "of", "to", "in", "on", "and", "or", "is", "are", "do", "does", "how", "what",
            "why", "who", "me", "my", "i", "you", "for", "with", "it", "its", "this", "that", "about", "give",
            "write", "tell", "explain", "describe", "short", "simple", "terms", "make", "can", "be", "was",
            "were", "which", "some", "good", "five", "three", "four", "list", "name"}
    return {w for w in re.findall(r"[a-z']+", text.lower()) if w not in stop}


def build(shipped: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """(the prompts kept, in order; (dropped prompt, the held-out prompt it overlapped))."""
    held = shipped["held_out"]
    seen = set(shipped["train"]) | set(held)
    held_words = [(h, content_words(h)) for h in held]
    kept, dropped = [], []
    for template, fillers in KINDS:
        for f in fillers:
            p = template.format(f)
            if p in seen:
                dropped.append((p, "a shipped prompt"))
                continue
            w = content_words(p)
            near = next((h for h, hw in held_words if w and len(w & hw) / len(w | hw) >= 0.5), None)
            if near is not None:
                dropped.append((p, near))
                continue
            seen.add(p)
            kept.append(p)
    return kept, dropped


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    shipped = json.loads((HERE / "drafter_prompts.json").read_text())
    kept, dropped = build(shipped)
    doc = {"about": "More training prompts for tpumk's SmolLM2-135M-Instruct drafter (issue 56), rendered by "
                    "benchmarks/drafter_more_prompts.py (templates x topics). Training only: none equals a prompt of "
                    "drafter_prompts.json or overlaps a held-out prompt's content words by Jaccard >= 0.5.",
           "train": kept}
    fd, tmp = tempfile.mkstemp(dir=a.out.parent, prefix=f".{a.out.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, a.out)
    for p, h in dropped:
        print(f"dropped {p!r} (near {h!r})")
    print(f"wrote {a.out}: {len(kept)} prompts")


if __name__ == "__main__":
    main()
